"""What building or running a TensorRT engine needs on this machine: the ``tensorrt`` package
and a GPU; each missing piece is a one-line error naming what to install."""

from __future__ import annotations

from tqexport.errors import TQExportError

INSTALL_HINT = (
    "TensorRT is not installed: on a machine with an NVIDIA GPU run "
    "`pip install 'tensorrt>=10.9'` (CUDA 12), then rerun"
)


def require_tensorrt():
    """The ``tensorrt`` module, or a one-line :class:`TQExportError` naming the install."""
    try:
        import tensorrt
    except ImportError:
        raise TQExportError(INSTALL_HINT) from None
    return tensorrt


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise TQExportError(
            "building or running a TensorRT engine needs an NVIDIA GPU, and torch sees none "
            "(install a CUDA build of torch on a GPU machine)"
        )
