"""Native ONNX Runtime kernels (``plugins/``): their generated constants, build and loading."""
