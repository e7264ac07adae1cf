"""KV-cache dtype registry and quant modes, named exactly as vLLM's ``--kv-cache-dtype``.

Every other module asks this registry what a name means; nothing else parses dtype strings.
Modes are serialized by NAME (vLLM renumbered its enum twice).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tqexport.errors import TQExportError


class KVQuantMode(enum.Enum):
    """How a layer's KV cache is quantized (vLLM's KVQuantMode, stored by name)."""

    NONE = "NONE"
    FP8_PER_TENSOR = "FP8_PER_TENSOR"
    INT8_PER_TOKEN_HEAD = "INT8_PER_TOKEN_HEAD"
    FP8_PER_TOKEN_HEAD = "FP8_PER_TOKEN_HEAD"
    INT4_PER_TOKEN_HEAD = "INT4_PER_TOKEN_HEAD"
    NVFP4 = "NVFP4"
    TURBOQUANT = "TURBOQUANT"

    @property
    def is_quantized(self) -> bool:
        return self is not KVQuantMode.NONE

    @property
    def is_per_token_head(self) -> bool:
        return self in _PER_TOKEN_HEAD

    @property
    def is_turboquant(self) -> bool:
        return self is KVQuantMode.TURBOQUANT

    @property
    def uses_layer_scales(self) -> bool:
        """Whether the layer carries fp32 k/v scales (fp8 per-tensor; nvfp4 global scales)."""
        return self in (KVQuantMode.FP8_PER_TENSOR, KVQuantMode.NVFP4)

    @classmethod
    def from_name(cls, name: str) -> KVQuantMode:
        try:
            return cls[name]
        except KeyError:
            valid = ", ".join(m.name for m in cls)
            raise KVDtypeError(f"unknown KV quant mode {name!r}; valid modes: {valid}") from None


_PER_TOKEN_HEAD = frozenset(
    {
        KVQuantMode.INT8_PER_TOKEN_HEAD,
        KVQuantMode.FP8_PER_TOKEN_HEAD,
        KVQuantMode.INT4_PER_TOKEN_HEAD,
    }
)


class KVDtypeError(TQExportError):
    """A kv-cache dtype name that tqexport cannot use; the message names the fix."""


@dataclass(frozen=True)
class KVCacheDType:
    """What one ``--kv-cache-dtype`` name means for storage.

    ``element`` is the logical element format of K/V data ("model" = the model's own dtype).
    ``data_bits`` counts payload bits per element, excluding scales, norms and zero points;
    the exact bytes per token-head (metadata included) come from ``spec.KVCacheSpec``.
    """

    name: str
    mode: KVQuantMode
    element: str
    data_bits: int | None
    summary: str
    #: a tqexport-native name (``tqx_*``), not one vLLM knows
    native: bool = False

    @property
    def is_turboquant(self) -> bool:
        return self.mode.is_turboquant

    @property
    def takes_key_transform(self) -> bool:
        """A tqexport-native TurboQuant dtype: the only caches a key transform may change (a
        vLLM name promises vLLM's cache contents)."""
        return self.native and self.mode.is_turboquant


def _entry(name, mode, element, bits, summary):
    return KVCacheDType(name, mode, element, bits, summary, native=name.startswith("tqx_"))


_M = KVQuantMode
KV_CACHE_DTYPES: dict[str, KVCacheDType] = {
    d.name: d
    for d in (
        _entry("auto", _M.NONE, "model", None, "unquantized, the model's dtype"),
        _entry("float16", _M.NONE, "float16", 16, "unquantized fp16"),
        _entry("bfloat16", _M.NONE, "bfloat16", 16, "unquantized bf16"),
        _entry("fp8", _M.FP8_PER_TENSOR, "float8_e4m3fn", 8, "fp8 e4m3, per-layer scales"),
        _entry("fp8_e4m3", _M.FP8_PER_TENSOR, "float8_e4m3fn", 8, "fp8 e4m3, per-layer scales"),
        _entry("fp8_e5m2", _M.FP8_PER_TENSOR, "float8_e5m2", 8, "fp8 e5m2, per-layer scales"),
        _entry(
            "int8_per_token_head",
            _M.INT8_PER_TOKEN_HEAD,
            "int8",
            8,
            "int8 symmetric, fp32 scale per token and head",
        ),
        _entry(
            "fp8_per_token_head",
            _M.FP8_PER_TOKEN_HEAD,
            "float8_e4m3fn",
            8,
            "fp8 e4m3, fp32 scale per token and head",
        ),
        _entry(
            "int4_per_token_head",
            _M.INT4_PER_TOKEN_HEAD,
            "uint4",
            4,
            "int4 asymmetric, fp32 scale + zero point per token and head",
        ),
        _entry("nvfp4", _M.NVFP4, "float4_e2m1", 4, "e2m1 with fp8 scale per 16 + fp32 global"),
        _entry(
            "turboquant_k8v4",
            _M.TURBOQUANT,
            "slot",
            None,
            "TurboQuant: fp8 keys, 4-bit values",
        ),
        _entry(
            "turboquant_4bit_nc",
            _M.TURBOQUANT,
            "slot",
            None,
            "TurboQuant: 4-bit Hadamard+Lloyd-Max keys (norm-corrected), 4-bit values",
        ),
        _entry(
            "turboquant_k3v4_nc",
            _M.TURBOQUANT,
            "slot",
            None,
            "TurboQuant: 3-bit keys (norm-corrected), 4-bit values",
        ),
        _entry(
            "turboquant_3bit_nc",
            _M.TURBOQUANT,
            "slot",
            None,
            "TurboQuant: 3-bit keys (norm-corrected), 3-bit values",
        ),
        _entry(
            "tqx_k4v4_g32",
            _M.TURBOQUANT,
            "slot",
            None,
            "tqexport-native TurboQuant: 4-bit keys (norm-corrected), 4-bit values, scale+zero "
            "per 32 values",
        ),
        _entry(
            "tqx_k4v3_g32",
            _M.TURBOQUANT,
            "slot",
            None,
            "tqexport-native TurboQuant: 4-bit keys (norm-corrected), 3-bit values, scale+zero "
            "per 32 values",
        ),
        _entry(
            "tqx_k4v4",
            _M.TURBOQUANT,
            "slot",
            None,
            "tqexport-native TurboQuant: turboquant_4bit_nc's slot layout, keys may be transformed",
        ),
        _entry(
            "tqx_k3v3",
            _M.TURBOQUANT,
            "slot",
            None,
            "tqexport-native TurboQuant: turboquant_3bit_nc's slot layout, keys may be transformed",
        ),
        _entry(
            "tqx_k4v3_mse",
            _M.TURBOQUANT,
            "slot",
            None,
            "tqexport-native TurboQuant: 4-bit keys, 3-bit values quantized like keys (rotated, "
            "Lloyd-Max, fp16 norm; both norm-corrected)",
        ),
        _entry(
            "tqx_k4v2_mse",
            _M.TURBOQUANT,
            "slot",
            None,
            "tqexport-native TurboQuant: 4-bit keys, 2-bit values quantized like keys (rotated, "
            "Lloyd-Max, fp16 norm; both norm-corrected)",
        ),
        _entry(
            "tqx_k3v2_mse",
            _M.TURBOQUANT,
            "slot",
            None,
            "tqexport-native TurboQuant: 3-bit keys, 2-bit values quantized like keys (rotated, "
            "Lloyd-Max, fp16 norm; both norm-corrected)",
        ),
    )
}

#: vLLM names that are hardware- or MLA-specific, with why tqexport refuses them.
UNSUPPORTED_VLLM_DTYPES: dict[str, str] = {
    "fp8_inc": "Intel Gaudi (INC) specific fp8 cache",
    "fp8_ds_mla": "DeepSeek MLA latent-cache layout, not a per-head K/V cache",
    "nvfp4_ds_mla": "DeepSeek MLA latent-cache layout, not a per-head K/V cache",
    "nvfp4_4over6": "Blackwell-specific nvfp4 variant with a 4-over-6 scale rule",
}


def kv_cache_dtype_names() -> list[str]:
    return list(KV_CACHE_DTYPES)


def parse_kv_cache_dtype(name: str) -> KVCacheDType:
    """Return the registry entry for a vLLM kv-cache dtype name, or raise KVDtypeError."""
    entry = KV_CACHE_DTYPES.get(name)
    if entry is not None:
        return entry
    valid = ", ".join(KV_CACHE_DTYPES)
    if name in UNSUPPORTED_VLLM_DTYPES:
        raise KVDtypeError(
            f"kv-cache dtype {name!r} is not supported by tqexport "
            f"({UNSUPPORTED_VLLM_DTYPES[name]}); use one of: {valid}"
        )
    raise KVDtypeError(f"unknown kv-cache dtype {name!r}; valid names: {valid}")


def quant_mode_of(name: str) -> KVQuantMode:
    """The quant mode of a registered kv-cache dtype name (an unknown name raises KVDtypeError)."""
    return parse_kv_cache_dtype(name).mode
