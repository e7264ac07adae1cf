"""Exact key transforms (kvquant.transforms): attention through transformed keys equals the
plain one, the spec stores and checks them, resolve refuses what is not exact or not native,
and a built artifact holds them in its graph."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import describe, prefill_chunks

from tqexport.errors import TQExportError
from tqexport.kvplan.resolve import ResolveError, resolve
from tqexport.kvquant import transforms
from tqexport.kvquant.transforms import KeyStats, KeyTransform, fit, parse_key_transform
from tqexport.models.loader import load_model
from tqexport.spec import (
    BuildRequest,
    LayerSpec,
    SpecError,
    cache_spec,
    layer_from_dict,
    spec_from_json,
)


def test_parse_key_transform_orders_kinds_and_refuses_typos():
    assert parse_key_transform("none") == ()
    assert parse_key_transform("signs+center") == ("center", "signs")
    assert parse_key_transform("smooth") == ("smooth",)
    for bad in ("", "centre", "center+center", "center,smooth", "none+signs"):
        with pytest.raises(TQExportError, match="kinds joined by"):
            parse_key_transform(bad)


def _random_transform(kinds, kvh, d, seed):
    g = np.random.default_rng(seed)
    center = tuple(float(x) for x in g.normal(0, 0.5, kvh * d).astype(np.float32))
    scale = g.uniform(0.25, 4.0, kvh * d) * g.choice([-1.0, 1.0], kvh * d)
    return KeyTransform(
        kinds,
        kvh,
        d,
        center=center if "center" in kinds else None,
        scale=tuple(float(x) for x in scale.astype(np.float32))
        if len(kinds) > 1 or kinds != ("center",)
        else None,
        seed=seed if "signs" in kinds else None,
    )


def _unquantized_with_window(lm, window):
    """tiny-llama's plan with every layer's caches unquantized but a recent window kept: the
    two segments attention reads, with nothing quantized to blur the comparison."""
    spec = resolve(
        lm.description, BuildRequest("tqx_k4v4", boundary=False, recent_window=window)
    ).spec
    layers = []
    for la in spec.layers:
        c = la.cache
        plain = cache_spec(c.window, kv_cache_dtype="auto", num_kv_heads=c.num_kv_heads,
                           head_size=c.head_size, block_size=c.block_size,
                           model_dtype=c.model_dtype)  # fmt: skip
        layers.append(dataclasses.replace(la, cache=plain))
    return dataclasses.replace(spec, layers=tuple(layers), request=None)


@pytest.mark.parametrize("kinds", [("center",), ("smooth", "signs"), ("center", "smooth", "signs")])
@pytest.mark.parametrize("window", [0, 4])
def test_attention_through_transformed_keys_equals_the_plain_one(kinds, window):
    """Transformed but unquantized: logits within 1e-5 of the plain path over a chunked
    prefill, with and without a recent window (both segments must be shifted alike: had only
    one segment held centered keys, older and recent scores would differ by q.center)."""
    lm = load_model("tiny-llama", "float32")
    if window:
        plain = _unquantized_with_window(lm, window)
    else:
        plain = resolve(lm.description, BuildRequest("auto")).spec
    layers = tuple(
        dataclasses.replace(
            la,
            key_transform=_random_transform(
                kinds, la.cache.num_kv_heads, la.cache.head_size, la.index
            ),  # fmt: skip
        )
        for la in plain.layers
    )
    moved = dataclasses.replace(plain, layers=layers)
    tokens = list(range(3, 23))
    a = prefill_chunks(lm, plain, tokens, chunk=6)
    b = prefill_chunks(lm, moved, tokens, chunk=6)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    if "center" in kinds:  # the keys the caches hold did move
        la = plain.layers[0]
        assert not torch.allclose(b.caches[la.onnx_input("k")], a.caches[la.onnx_input("k")])


def test_fit_centers_smooths_and_signs_as_documented():
    g = torch.Generator().manual_seed(0)
    t, h, kvh, d = 300, 4, 2, 8
    k = torch.randn(t, kvh, d, generator=g) * torch.linspace(0.1, 3.0, d) + 2.0
    q = torch.randn(t, h, d, generator=g)
    stats = KeyStats()
    stats.add(q, k, torch.arange(t))
    assert stats.count == t - transforms.SINK_POSITIONS
    kt = fit(("center", "smooth", "signs"), stats, layer_index=3, seed=7)
    keep = k[transforms.SINK_POSITIONS :].double()
    center = np.asarray(kt.center).reshape(kvh, d)
    np.testing.assert_allclose(center, keep.mean(0).numpy(), rtol=1e-6, atol=1e-6)
    scale = np.asarray(kt.scale).reshape(kvh, d)
    # geometric mean 1 per head; smaller scales on the channels with larger keys
    np.testing.assert_allclose(np.exp(np.log(np.abs(scale)).mean(1)), 1.0, rtol=1e-5)
    assert np.all(np.diff(np.abs(scale), axis=1) < 0)
    signs = np.sign(scale)
    again = fit(("signs",), None, layer_index=3, seed=7, num_kv_heads=kvh, head_size=d)
    assert np.array_equal(np.asarray(again.scale).reshape(kvh, d), signs)
    other = fit(("signs",), None, layer_index=4, seed=7, num_kv_heads=kvh, head_size=d)
    assert other.scale != again.scale  # each layer draws its own signs
    assert all(float(np.float32(x)) == x for x in kt.center + kt.scale)  # float32-exact
    with pytest.raises(TQExportError, match="no calibration tokens"):
        fit(("center",), KeyStats(), layer_index=0)


def _layer(kind="tqx_k4v4", softcap=None, kt=None):
    c = cache_spec(None, kv_cache_dtype=kind, num_kv_heads=2, head_size=64, block_size=16,
                   model_dtype="float32")  # fmt: skip
    return LayerSpec(index=0, module="m", cache=c, scale=0.125, softcap=softcap, key_transform=kt)


def test_the_spec_round_trips_a_transform_and_refuses_what_is_not_exact_or_native():
    kt = _random_transform(("center", "smooth", "signs"), 2, 64, 1)
    d = _layer(kt=kt).to_dict()
    assert layer_from_dict(d, 0).key_transform == kt
    assert "key_transform" not in _layer().to_dict()  # vLLM-compatible layers stay as they were
    cases = [
        (_layer("turboquant_4bit_nc").to_dict() | {"key_transform": d["key_transform"]},
         "tqexport-native"),
        (_layer(softcap=30.0).to_dict() | {"key_transform": d["key_transform"]}, "softcap"),
        (d | {"key_transform": d["key_transform"] | {"version": 2}}, "version 2"),
        (d | {"key_transform": d["key_transform"] | {"center": [0.0] * 5}}, "has 5 values"),
        (d | {"key_transform": d["key_transform"] | {"scale": ["x"] * 128}}, "lists of numbers"),
        (d | {"key_transform": d["key_transform"] | {"seed": None}}, "seed exactly"),
        (d | {"key_transform": d["key_transform"] | {"extra": 1}}, "unknown field"),
    ]  # fmt: skip
    for bad, why in cases:
        with pytest.raises(SpecError, match=why):
            layer_from_dict(bad, 0)


def test_resolve_refuses_transforms_on_vllm_names_and_centering_under_softcap():
    with pytest.raises(ResolveError, match="tqexport-native TurboQuant"):
        resolve(
            describe([None] * 2),
            BuildRequest("turboquant_4bit_nc", key_transform=("signs",), boundary=False),
        )
    soft = describe([None, None])
    soft = dataclasses.replace(
        soft, layers=tuple(dataclasses.replace(la, softcap=50.0) for la in soft.layers)
    )
    with pytest.raises(ResolveError, match="softcap"):
        resolve(soft, BuildRequest("tqx_k4v4", key_transform=("center",), boundary=False))
    ok = resolve(soft, BuildRequest("tqx_k4v4", key_transform=("smooth",), boundary=False)).spec
    assert ok.request.key_transform_label == "smooth"


def test_build_stores_fitted_transforms_that_the_graph_and_parity_follow(tmp_path):
    """A tqx_k4v4 build with every transform and a recent window: each quantized layer's spec
    holds its fitted transform, the graph centers keys ahead of the cache ops, and ORT agrees
    with the torch reference by the parity rule."""
    import onnx

    from tqexport.contract.artifact import open_artifact
    from tqexport.export.artifact_build import build_artifact
    from tqexport.spec import BuildRequest
    from tqexport.verify.parity import run_parity

    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"token{i} is text number {i}." for i in range(200)))
    out = tmp_path / "art"
    options = BuildRequest(kv_cache_dtype="tqx_k4v4", recent_window=4,
                           key_transform="center+smooth+signs", calibration_text=text)  # fmt: skip
    result = build_artifact("tiny-llama", out, options)
    spec = spec_from_json((out / "tqexport.json").read_text())
    assert spec.request.key_transform_label == "center+smooth+signs"
    for la in spec.layers:
        assert (la.key_transform is not None) == la.mode.is_quantized
        if la.key_transform is not None:
            assert la.key_transform.kinds == ("center", "smooth", "signs")
    assert spec == result.spec
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    quantized = sum(la.mode.is_quantized for la in spec.layers)
    assert quantized and sum(n.op_type == "Sub" for n in graph.node) == quantized
    assert run_parity(open_artifact(out), steps=2, prompt_len=12, batch=2).ok
    info = json.loads((out / "tqexport.json").read_text())
    plain = [d["index"] for d in info["layers"] if "key_transform" not in d]
    assert plain == [la.index for la in spec.layers if not la.mode.is_quantized]
