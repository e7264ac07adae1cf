"""Hostile tqexport.json files: loading is total. Every mutation of a real spec (bit flips,
truncation, non-UTF-8, deep nesting, NaN, wrong types, out-of-range sizes, deleted and added
keys) either loads as a spec that re-serializes and reloads to itself, or is refused with one
SpecError line; through ``tqexport inspect`` that is exit 0, or exit 2 with one ``error:`` line.
"""

import copy
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import onnx
import pytest

from tqexport.contract.artifact import open_artifact
from tqexport.contract.files import SPEC_METADATA_KEY
from tqexport.errors import TQExportError
from tqexport.export.artifact_build import resolve_spec
from tqexport.kvplan.resolve import resolve
from tqexport.models.config import describe_model
from tqexport.spec import BuildRequest, ModelSpec, SpecError, spec_from_json

SEED = 13
MUTATIONS_PER_BASE = 150

#: values put where the spec has something else: wrong types, edges, huge, negative, odd text
HOSTILE = [
    None, True, False, 0, -1, 1, 2, 3, 8, 16, 17, 32, 64, 255, 256, 257, 1024, 1025, 65536,
    2**31, 2**63, -(2**63), 10**30, 0.0, -0.0, 0.5, 1.5, 16.0, 1e308, -1e308, 5e-324, "", "x",
    "auto", "fp8", "fp8_e5m2", "turboquant_4bit_nc", "float16", "float64", "full", "NONE",
    "TURBOQUANT", "uint8", "num_blocks", "turboquant boundary", "--skip-layers 0", "sha256:0",
    "model.layers.0.self_attn", "a" * 5000, "\x00", "\x1b[2J", "\ud800", "\u2028", [], [1],
    [None], [[[[]]]], {}, {"a": 1}, {"window": 8, "group": 1}, list(range(64)),
]  # fmt: skip
NEW_KEYS = ["extra", "num_kv_head", "Block_size", "", "recent", "window", "io", "layers"]
#: raw JSON text spliced in where a value was
RAW_VALUES = [
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 45, "[" * 1000 + "]" * 1000,
    "[" * 100000 + "]" * 100000, '{"a": ' * 5000 + "1" + "}" * 5000, "00", "01", ".5", "+1",
    "0x10", "1_000", "true1", "\"\\ud800\"", "\"\\u0000\"",
]  # fmt: skip
NON_UTF8 = [b"\xff", b"\xfe", b"\xc3", b"\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf"]
PLACEHOLDER = "\x00tqexport-fuzz\x00"


@pytest.fixture(scope="module")
def bases(artifacts):
    """Real specs as builds write them: an fp8 artifact, a TurboQuant spec with a recent window
    (resolve_spec, as the build does, minus the export), a sliding/softcap model with skipped
    layers and no io section (resolve alone)."""
    fp8 = (artifacts("tiny-llama", "fp8") / "tqexport.json").read_bytes()
    lm = types.SimpleNamespace(description=describe_model("tiny-llama"))
    opts = BuildRequest(kv_cache_dtype="turboquant_4bit_nc", boundary=False, recent_window=8)
    tq = resolve_spec("tiny-llama", lm, opts)[0]
    gemma = resolve(
        describe_model("tiny-gemma2"),
        BuildRequest("turboquant_k8v4", ["0", "-1"], recent_window=32),
    )
    return {
        "fp8": fp8,
        "tq-recent": tq.to_json().encode(),
        "gemma2": gemma.spec.to_json().encode(),
    }


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _at(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _dump(doc, rng):
    return json.dumps(doc, indent=rng.choice([None, 2]), allow_nan=True)


def mutate(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One mutation of a spec file: (what was done, the new bytes)."""
    doc = json.loads(raw)
    paths = [p for p in _paths(doc) if p]
    kind = rng.choice(
        ["replace"] * 6
        + ["delete", "add", "swap", "dup", "raw", "bits", "bits", "truncate", "non_utf8"]
        + ["semantic", "semantic", "dup_key"]
    )
    if kind == "replace":
        path = rng.choice(paths)
        value = copy.deepcopy(rng.choice(HOSTILE))
        parent = _at(doc, path[:-1])
        parent[path[-1]] = value
        return f"replace {list(path)} = {value!r:.40}", _dump(doc, rng).encode()
    if kind == "delete":
        path = rng.choice(paths)
        del _at(doc, path[:-1])[path[-1]]
        return f"delete {list(path)}", _dump(doc, rng).encode()
    if kind == "add":
        dicts = [p for p in _paths(doc) if isinstance(_at(doc, p), dict)]
        path, key = rng.choice(dicts), rng.choice(NEW_KEYS)
        _at(doc, path)[key] = copy.deepcopy(rng.choice(HOSTILE))
        return f"add {list(path)}[{key!r}]", _dump(doc, rng).encode()
    if kind in ("swap", "dup"):
        lists = [p for p in _paths(doc) if isinstance(_at(doc, p), list) and _at(doc, p)]
        path = rng.choice(lists)
        items = _at(doc, path)
        i, j = rng.sample(range(len(items)), 2) if len(items) > 1 else (0, 0)
        if kind == "swap":
            items[i], items[j] = items[j], items[i]
        else:
            items.insert(j, copy.deepcopy(items[i]))
        return f"{kind} {list(path)} {i} {j}", _dump(doc, rng).encode()
    if kind == "raw":
        path, text = rng.choice(paths), rng.choice(RAW_VALUES)
        _at(doc, path[:-1])[path[-1]] = PLACEHOLDER
        out = _dump(doc, rng).replace(json.dumps(PLACEHOLDER), text)
        return f"raw {list(path)} = {text[:20]}", out.encode()
    if kind == "bits":
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return "bit flips", bytes(b)
    if kind == "truncate":
        n = rng.randrange(len(raw))
        return f"truncate at {n}", raw[:n]
    if kind == "non_utf8":
        n = rng.randrange(len(raw))
        return f"non-UTF-8 at {n}", raw[:n] + rng.choice(NON_UTF8) + raw[n:]
    if kind == "dup_key":
        return "duplicate key", raw.replace(b'"dtype"', b'"dtype": "float16", "dtype"', 1)
    # semantic: plausible edits, some valid (a rename, a reformat), some silently wrong before
    edit = rng.randrange(6)
    if edit == 0:
        doc["block_size"] = rng.choice([8, 32, 64])
        return "top-level block_size only", _dump(doc, rng).encode()
    if edit == 1:
        doc["model"]["name"] = rng.choice(["renamed", "my model", "Ünïcode"])
        return "model renamed", _dump(doc, rng).encode()
    if edit == 2:
        layer = rng.choice(doc["layers"])
        layer["scale"] = layer["scale"] * rng.choice([0.5, 2.0])
        return "layer scale changed", _dump(doc, rng).encode()
    if edit == 3:
        return "reformatted", json.dumps(doc, indent=rng.choice([None, 1, 4])).encode()
    if edit == 4:
        return "keys reordered", json.dumps(dict(reversed(list(doc.items())))).encode()
    doc["layers"][0]["skipped_by"] = rng.choice(["turboquant boundary", "--skip-layers 0", "x"])
    return "skipped_by set", _dump(doc, rng).encode()


def load(raw: bytes) -> ModelSpec | str:
    """The loaded spec (checked to round-trip), or the one-line message it was refused with."""
    try:
        spec = spec_from_json(raw)
    except TQExportError as e:
        message = str(e)
        assert isinstance(e, SpecError), type(e)
        assert message and len(message.splitlines()) == 1, message
        return message
    text = spec.to_json()
    back = spec_from_json(text)
    assert back == spec and back.to_json() == text
    assert spec_from_json(text.encode()) == spec
    return spec


def cases(bases):
    rng = random.Random(SEED)
    out = []
    for name, raw in bases.items():
        out.append((name, "unchanged", raw))
        for _ in range(MUTATIONS_PER_BASE):
            what, new = mutate(raw, rng)
            out.append((name, what, new))
    return out


def test_loader_is_total_on_mutated_specs(bases):
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    accepted, rejected, slowest = [], [], 0.0
    for base, what, raw in cases(bases):
        start = time.perf_counter()
        try:
            result = load(raw)
        except Exception as e:  # anything but a spec or one SpecError line is a bug
            pytest.fail(f"{base}: {what}: {type(e).__name__}: {e}"[:2000])
        slowest = max(slowest, time.perf_counter() - start)
        (accepted if isinstance(result, ModelSpec) else rejected).append((base, what))
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    print(f"\nspec fuzz: {len(accepted)} accepted, {len(rejected)} rejected, slowest "
          f"{slowest * 1000:.0f} ms, peak RSS growth {peak_mib:.0f} MiB")  # fmt: skip
    assert len(accepted) >= 15 and len(rejected) >= 300
    assert {b for b, _ in accepted} == set(bases)
    assert slowest < 10 and peak_mib < 1024


# -- the same through the command line -----------------------------------------------------

CLI_CASES = [
    ("unchanged", lambda d: d, True),
    ("model renamed", lambda d: {**d, "model": {**d["model"], "name": "renamed"}}, True),
    ("top-level block_size 32", lambda d: {**d, "block_size": 32}, False),
    ("num_kv_heads null", lambda d: _layer(d, 1, num_kv_heads=None), False),
    ("head_size 65536", lambda d: _layer(d, 0, head_size=65536), False),
]


def _layer(d, i, **fields):
    d = copy.deepcopy(d)
    d["layers"][i].update(fields)
    return d


def _cli_texts(raw, fuzzed):
    """Hand-picked cases (each silently wrong, a crash or a hang before), then one accepted
    and one refused case of the fuzz above."""
    doc = json.loads(raw)
    for name, edit, ok in CLI_CASES:
        yield name, json.dumps(edit(doc), indent=2).encode(), ok
    nan = raw.replace(b'"scale": 0.125', b'"scale": NaN', 1)
    assert nan != raw
    yield "NaN scale", nan, False
    yield "non-UTF-8", raw[:100] + b"\xff" + raw[100:], False
    yield "deep nesting", b"[" * 100000 + b"]" * 100000, False
    original = json.loads(raw)

    def changed(new):
        try:
            return json.loads(new) != original
        except (ValueError, RecursionError):
            return True

    mutations = [(what, new) for base, what, new in fuzzed if base == "fp8" and changed(new)]
    results = {what: isinstance(load(new), ModelSpec) for what, new in mutations}
    for ok in (True, False):
        what, new = next((w, n) for w, n in mutations if results[w] == ok)
        yield f"fuzz: {what}", new, ok


def _copy_with_spec(src, dst, raw, graph):
    """The artifact at ``dst`` with ``raw`` as tqexport.json, embedded in the graph too when it
    is text (so a mutation reaches the field checks, not just the "differs" check)."""
    dst.mkdir()
    os.link(src / "model.onnx.data", dst / "model.onnx.data")
    (dst / "tqexport.json").write_bytes(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    model = onnx.ModelProto()
    model.CopyFrom(graph)
    if text is not None:
        for prop in model.metadata_props:
            if prop.key == SPEC_METADATA_KEY:
                prop.value = text
    (dst / "model.onnx").write_bytes(model.SerializeToString())


def test_inspect_on_mutated_artifacts(tmp_path, artifacts, bases):
    src = artifacts("tiny-llama", "fp8")
    graph = onnx.load(str(src / "model.onnx"), load_external_data=False)
    runs = []
    texts = _cli_texts((src / "tqexport.json").read_bytes(), cases(bases))
    for i, (name, raw, ok) in enumerate(texts):
        dst = tmp_path / f"case{i}"
        _copy_with_spec(src, dst, raw, graph)
        assert isinstance(load(raw), ModelSpec) == ok, name
        if ok:
            open_artifact(dst)
        runs.append((name, dst, ok))

    def inspect(dst):
        cmd = [sys.executable, "-m", "tqexport", "inspect", str(dst)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(inspect, [dst for _, dst, _ in runs]))
    for (name, _, ok), r in zip(runs, results, strict=True):
        assert "Traceback" not in r.stderr, (name, r.stderr)
        assert r.returncode == (0 if ok else 2), (name, r.returncode, r.stderr)
        if not ok:
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), (name, r.stderr)


# -- external data stays inside the artifact -----------------------------------------------


def _relocate(d, key, value):
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.external_data)
    next(e for e in tensor.external_data if e.key == key).value = value
    (d / "model.onnx").write_bytes(model.SerializeToString())


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("location", "/etc/passwd", "keeps its data at '/etc/passwd', not in the artifact's"),
        ("location", "../model.onnx.data", "keeps its data at '../model.onnx.data'"),
        ("location", "sub/../model.onnx.data", "keeps its data at 'sub/../model.onnx.data'"),
        ("location", "./model.onnx.data", "keeps its data at './model.onnx.data'"),
        ("location", "tqexport.json", "keeps its data at 'tqexport.json'"),
        ("offset", "-1", "external-data offset '-1', not a byte count"),
        ("length", "lots", "external-data length 'lots', not a byte count"),
        ("length", "9" * 30, "not a byte count"),
    ],
)
def test_external_data_outside_the_artifact_is_refused(tmp_path, artifacts, key, value, message):
    dst = tmp_path / "a"
    shutil.copytree(artifacts("tiny-llama", "fp8"), dst)
    _relocate(dst, key, value)
    with pytest.raises(TQExportError, match=message) as e:
        open_artifact(dst)
    assert len(str(e.value).splitlines()) == 1


def test_weights_file_linked_outside_the_artifact_is_refused(tmp_path, artifacts):
    src = artifacts("tiny-llama", "fp8")
    dst = tmp_path / "a"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.onnx.data"))
    (dst / "model.onnx.data").symlink_to(src / "model.onnx.data")
    with pytest.raises(TQExportError, match="is a link to .* outside the artifact"):
        open_artifact(dst)
    (dst / "model.onnx.data").unlink()
    shutil.copy(src / "model.onnx.data", dst / "weights.bin")
    (dst / "model.onnx.data").symlink_to("weights.bin")  # a link inside the artifact is fine
    assert open_artifact(dst).spec == open_artifact(src).spec


def test_dtypes_with_a_huge_head_size_is_refused_before_any_table():
    """``dtypes --head-size 65536`` used to build a 16 GiB Hadamard matrix."""
    r = subprocess.run(
        [sys.executable, "-m", "tqexport", "dtypes", "--head-size", "65536", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == ["error: --head-size must be at most 1024, got 65536"]
