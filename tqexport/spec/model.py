"""The whole spec, ``tqexport.json``: model identity, per-layer specs, cache groups, the build
request it was resolved from, and its graph I/O. Checked when made, built or loaded alike
(:mod:`tqexport.spec.checks`); read from JSON by :mod:`tqexport.spec.load`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tqexport import __version__
from tqexport.spec import checks
from tqexport.spec.graph_io import graph_io
from tqexport.spec.groups import CacheGroup
from tqexport.spec.layer import LayerSpec
from tqexport.spec.limits import SCHEMA_VERSION
from tqexport.spec.request import BuildRequest
from tqexport.spec.weights import WeightsSpec


@dataclass(frozen=True)
class ModelSpec:
    """The whole ``tqexport.json``: model identity, layers, groups, provenance, graph I/O."""

    model: dict[str, Any]
    dtype: str
    block_size: int
    layers: tuple[LayerSpec, ...]
    groups: tuple[CacheGroup, ...]
    #: what the build was asked for (provenance; None: not recorded, written as {})
    request: BuildRequest | None = None
    io: dict[str, Any] | None = None
    #: how the weights are stored (None: every matrix in the model dtype)
    weights: WeightsSpec | None = None
    tqexport_version: str = __version__

    def __post_init__(self):
        # Built or loaded, a spec is checked the same way: a build never writes what a load
        # would refuse.
        checks.check_top(self)
        checks.check_structure(self)
        checks.check_fields(self)

    def layer(self, index: int) -> LayerSpec:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise KeyError(index)

    @property
    def max_position_embeddings(self) -> int | None:
        """The model's position limit as the build recorded it (None: built before tqexport
        recorded it, or the model's config has none)."""
        return self.model.get("max_position_embeddings")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes each cached token adds (recent-window caches, bounded per sequence, aside)."""
        return sum(layer.cache.bytes_per_token for layer in self.layers)

    @property
    def recent_window(self) -> int:
        """The largest recent window of any layer (0 = none)."""
        return max((la.recent_window for la in self.layers), default=0)

    @property
    def sink_tokens(self) -> int:
        """The most sink tokens any layer keeps (0 = none)."""
        return max((la.sink_tokens for la in self.layers), default=0)

    @property
    def recent_bytes_per_token(self) -> int:
        """Bytes per token of the recent-window caches (they hold at most their window)."""
        return sum(la.recent.bytes_per_token for la in self.layers if la.recent is not None)

    @property
    def block_bytes(self) -> int:
        """Bytes one block id costs across every cache tensor of every layer."""
        return sum(la.page_size_bytes for la in self.layers)

    def group_block_bytes(self, group: CacheGroup) -> int:
        """Bytes one block of ``group`` holds over its layers' caches."""
        return sum(
            b.cache.page_size_bytes
            for i in group.layers
            for b in self.layer(i).bindings
            if b.group == group.id
        )

    @property
    def bf16_bytes_per_token(self) -> int:
        """What the same layers would take with bf16 K and V caches."""
        return sum(4 * la.cache.head_size * la.cache.num_kv_heads for la in self.layers)

    def graph_io(self) -> dict[str, list[dict[str, Any]]]:
        """The graph's input/output contract: names, dtypes and symbolic shapes, in order."""
        return graph_io(self)

    @cached_property
    def input_names(self) -> tuple[str, ...]:
        """Graph input names in order (derived once: the executor needs them every step)."""
        return tuple(x["name"] for x in self.graph_io()["inputs"])

    def plan_dict(self) -> dict[str, Any]:
        """The per-layer part of the spec (what ``tqexport plan --json`` prints)."""
        return {
            "groups": [g.to_dict() for g in self.groups],
            "layers": [la.to_dict() for la in self.layers],
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "tqexport_version": self.tqexport_version,
            "model": self.model,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "request": {} if self.request is None else self.request.to_dict(),
            **({} if self.weights is None else {"weights": self.weights.to_dict()}),
            **self.plan_dict(),
            "io": self.io,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


def config_digest(config: dict[str, Any]) -> str:
    """sha256 of a model config, canonically serialized (identifies what a spec was built for)."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()
