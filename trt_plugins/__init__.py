"""TensorRT plugins for the ``tqexport`` ONNX nodes: AOT Triton kernels, one launch per node.

``contract`` and ``ptx`` are plain Python (tested without TensorRT); ``plugins`` is the thin
``tensorrt.plugin`` glue and imports only where TensorRT is installed.
"""
