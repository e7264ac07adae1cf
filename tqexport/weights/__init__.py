"""How an artifact stores its weights (``--weights``): a GGUF's own blocks or ONNX Runtime's
quantizer's (``blocks``, ``gguf_index``, ``gguf_source``), the export model with stand-ins
where they go (``placeholders``, ``export``), and the standard ONNX that replaces the
stand-ins (``graph``); ``precision`` says what each choice means per source."""
