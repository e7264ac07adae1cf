"""A GGUF file's tensor index and its architecture, read without parsing its metadata values.

gguf's own reader turns every metadata value into Python and numpy objects: for a 262k-token
vocabulary (Gemma 3) that is about 850 MB of memory held while the file is open, more than the
file's weights. A build needs only the tensor index (name, shape, type, where the bytes are)
and ``general.architecture``, so this walks the metadata by its lengths and maps the tensor
data (the layout is GGUF version 2/3's: header, key-value pairs, tensor infos, aligned data).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tqexport.errors import TQExportError

MAGIC = b"GGUF"
#: metadata value types: fixed sizes; 8 is a string, 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class IndexedTensor:
    """One tensor of the file: ``shape`` as GGUF lists it (innermost first), its type, and
    where its bytes are; :attr:`data` reads them (a fresh array each time: the file is not
    kept mapped, so its pages do not stay in this process's memory)."""

    path: Path
    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int

    @property
    def data(self) -> np.ndarray:
        """The bytes, ``[rows, bytes per row]`` for a matrix."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            raw = np.fromfile(f, dtype=np.uint8, count=self.nbytes)
        if raw.size != self.nbytes:
            raise TQExportError(f"{self.path} ends inside tensor {self.name}; download it again")
        if len(self.shape) < 2:
            return raw
        return raw.reshape(int(np.prod(self.shape[1:], dtype=np.int64)), -1)


class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ValueError("ends early")
        out = self.buf[self.pos : self.pos + n].tobytes()
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8", errors="replace")

    def skip(self, kind: int) -> None:
        if kind == _STRING:
            n = self.u64()
            self.pos += n
        elif kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _SIZES:
                self.pos += _SIZES[item] * count
            else:
                for _ in range(count):
                    self.skip(item)
        elif kind in _SIZES:
            self.pos += _SIZES[kind]
        else:
            raise ValueError(f"unknown metadata type {kind}")


def read_index(path: Path) -> tuple[str, list[IndexedTensor]]:
    """(``general.architecture``, every tensor) of the GGUF file ``path``; one error line for
    a file that is not one or ends early."""
    import gguf

    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(buf)
        if cur.take(4) != MAGIC:
            raise ValueError("no GGUF magic")
        version = cur.u32()
        if version not in (2, 3):
            raise ValueError(f"version {version}")
        tensors, kvs = cur.u64(), cur.u64()
        arch, alignment = None, DEFAULT_ALIGNMENT
        for _ in range(kvs):
            key, kind = cur.string(), cur.u32()
            if key == "general.architecture" and kind == _STRING:
                arch = cur.string()
            elif key == "general.alignment" and kind == 4:
                alignment = cur.u32()
            else:
                cur.skip(kind)
        infos = []
        for _ in range(tensors):
            name = cur.string()
            dims = tuple(cur.u64() for _ in range(cur.u32()))
            infos.append((name, dims, cur.u32(), cur.u64()))
        start = -(-cur.pos // alignment) * alignment
        out = []
        for name, dims, kind, offset in infos:
            qtype = gguf.GGMLQuantizationType(kind)
            per, size = gguf.GGML_QUANT_SIZES[qtype]
            inner = dims[0] if dims else 1
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            nbytes = rows * (inner // per) * size
            at = start + offset
            if inner % per or at + nbytes > len(buf):
                raise ValueError(f"tensor {name} ends past the file or splits a block")
            out.append(IndexedTensor(Path(path), name, dims, qtype.name, at, nbytes))
    except (OSError, ValueError, struct.error) as e:
        raise TQExportError(
            f"cannot read the tensors of {path} ({e}); the file is truncated or damaged, "
            "download it again"
        ) from None
    if arch is None:
        raise TQExportError(f"{path} names no general.architecture; it is not a model GGUF")
    return arch, out


def as_array(t: IndexedTensor) -> np.ndarray:
    """A float tensor's values (F32/F16/BF16) or any tensor dequantized, in numpy's order
    (outermost first), as gguf's loader gives them to transformers."""
    from gguf import GGMLQuantizationType, quants

    shape = tuple(reversed(t.shape))
    if t.type_name == "F32":
        return np.asarray(t.data).view(np.float32).reshape(shape)
    if t.type_name == "F16":
        return np.asarray(t.data).view(np.float16).reshape(shape)
    return quants.dequantize(np.asarray(t.data), GGMLQuantizationType[t.type_name]).reshape(shape)
