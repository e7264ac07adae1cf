"""Native ONNX Runtime kernels (``plugins/``): their generated constants, build and loading."""

#: ``--kernels``: native where the library serves the artifact (else the function bodies, and
#: why), native only (an error when it cannot), or the function bodies
KERNEL_CHOICES = ("auto", "native", "bodies")
