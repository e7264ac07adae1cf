"""Export: ONNX graph with tqexport ops and function bodies; TensorRT engine build."""
