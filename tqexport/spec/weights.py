"""How an artifact stores its weights: the precision most of its stored matrices have, every
matrix that differs, and the accuracy level ONNX Runtime runs the block-quantized ones at. A
spec without this section (every artifact before weights were stored quantized) stores every
matrix in the model dtype."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from tqexport.spec.limits import MAX_TEXT, REBUILD, SpecError
from tqexport.spec.reading import as_object, choice_field, int_field, known_keys, str_field

#: what a stored matrix can be
PRECISIONS = ("int4", "int8", "fp16", "fp32")
#: at most this many matrices (4 per layer and the heads of the largest models, with room)
MAX_TENSORS = 1 << 16


@dataclass(frozen=True)
class StoredTensor:
    """One matrix: its precision, its block size (None for floats) and what it came from (a
    GGUF block type, ``rtn4``/``rtn8`` for ONNX Runtime's quantizer, or a float type)."""

    name: str
    precision: str
    block_size: int | None
    source: str

    def key(self) -> tuple:
        return self.precision, self.block_size, self.source

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "block_size": self.block_size, "source": self.source}


@dataclass(frozen=True)
class WeightsSpec:
    """Every matrix the artifact stores other than in the model dtype, and how ORT runs them."""

    tensors: tuple[StoredTensor, ...]
    accuracy_level: int

    @property
    def default(self) -> StoredTensor | None:
        """The (precision, block size, source) most matrices have (the first such on a tie)."""
        if not self.tensors:
            return None
        counts = Counter(t.key() for t in self.tensors)
        best = max(counts.values())
        return next(t for t in self.tensors if counts[t.key()] == best)

    def summary(self) -> str:
        """One line: how many matrices each (precision, block size, source) has."""
        counts = Counter(t.key() for t in self.tensors)
        parts = []
        for (precision, block, source), n in counts.most_common():
            what = f"{precision} blocks of {block}" if block else precision
            parts.append(f"{n} in {what} ({source})")
        return ", ".join(parts)

    def precision_of(self, name: str) -> str | None:
        return next((t.precision for t in self.tensors if t.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The default once, then only the matrices that differ from it."""
        d = self.default
        differs = {t.name: t.to_dict() for t in self.tensors if d is None or t.key() != d.key()}
        same = [t.name for t in self.tensors if d is not None and t.key() == d.key()]
        return {
            "accuracy_level": self.accuracy_level,
            "default": None if d is None else {**d.to_dict(), "tensors": same},
            "differs": differs,
        }


def weights_from_dict(value: Any) -> WeightsSpec:
    """The ``weights`` section of a loaded spec, every field checked (one :class:`SpecError`)."""
    w = as_object(value, "spec: field 'weights'")
    known_keys(w, ("accuracy_level", "default", "differs"), (), "weights")
    level = int_field(w, "accuracy_level", 0, 4, "weights")
    tensors = []
    if w["default"] is not None:
        d = as_object(w["default"], "weights: field 'default'")
        known_keys(d, ("precision", "block_size", "source", "tensors"), (), "weights default")
        names = d["tensors"]
        if not isinstance(names, list) or not 1 <= len(names) <= MAX_TENSORS:
            raise SpecError(f"weights default: field 'tensors' must list 1..{MAX_TENSORS} names"
                            f"{REBUILD}")  # fmt: skip
        for i, name in enumerate(names):
            str_field({"name": name}, "name", f"weights default tensor {i}")
            tensors.append(_tensor(name, d, "weights default"))
    differs = as_object(w["differs"], "weights: field 'differs'")
    if len(differs) > MAX_TENSORS:
        raise SpecError(f"weights: field 'differs' has more than {MAX_TENSORS} tensors{REBUILD}")
    for name, entry in differs.items():
        str_field({"name": name}, "name", "weights differs")
        e = as_object(entry, f"weights tensor {name[:40]!r}")
        known_keys(e, ("precision", "block_size", "source"), (), f"weights tensor {name[:40]!r}")
        tensors.append(_tensor(name, e, f"weights tensor {name[:40]!r}"))
    if len({t.name for t in tensors}) != len(tensors):
        raise SpecError(f"weights: a tensor is listed twice{REBUILD}")
    spec = WeightsSpec(tuple(tensors), level)
    if spec.to_dict() != {"accuracy_level": level, "default": w["default"], "differs": differs}:
        raise SpecError(
            f"weights: field 'default' is not the precision most tensors have (or a tensor "
            f"listed as differing has it){REBUILD}"
        )
    return spec


def _tensor(name: str, d: dict, where: str) -> StoredTensor:
    precision = choice_field(d, "precision", PRECISIONS, where)
    if precision.startswith("int"):
        block = int_field(d, "block_size", 16, 256, where)
    elif d.get("block_size") is not None:
        raise SpecError(f"{where}: a float tensor has no block_size{REBUILD}")
    else:
        block = None
    return StoredTensor(name, precision, block, str_field(d, "source", where, max_len=MAX_TEXT))
