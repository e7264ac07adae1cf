"""Triton kernels for the per-layer ops (CUDA; verified on CPU with TRITON_INTERPRET=1)."""
