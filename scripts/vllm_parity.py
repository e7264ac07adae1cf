"""Byte parity of tqexport's TurboQuant slots with vLLM's own store kernel (``make vllm-parity``).

Downloads vLLM's wheel without installing it (``pip download --no-deps``), unpacks only its
TurboQuant store kernel, centroid and config modules, loads them with vLLM's package imports
stubbed, and runs the store kernel in the Triton interpreter on fixed inputs (random heads and
edge cases: zeros, tiny and huge values, zero norms, rounding thresholds, NaN and +-inf). The
same inputs go through tqexport's reference cache write (``tqexport.ops.reference.write_cache``)
into a copy of the same pre-filled paged buffer, for every vLLM preset at D = 64, 128 and 256
(Gemma 3's); every byte of every block but the null block 0 is compared (vLLM never writes
block 0; tqexport sends padding tokens there). Exit status 1 on any difference, 2 when vLLM
cannot be fetched or loaded.

One piece of the interpreter is replaced: its fp32 -> fp8e4nv cast (k8v4 keys) does not round
like the GPU's, so it is given the GPU's ``cvt.rn.satfinite`` semantics (``--interpreter-fp8``
keeps the interpreter's own). Wheels and sources are cached under ``~/.cache/tqexport/vllm``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported, by anyone

import argparse  # noqa: E402
import ast  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
import zipfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

VLLM_VERSION = "0.33.0"
PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
HEAD_SIZES = (64, 128, 256)
# Files read from the wheel (vLLM 0.33.0 paths); the backend is read only for its Hadamard.
STORE = "vllm/v1/attention/ops/triton_turboquant_store.py"
CENTROIDS = "vllm/model_executor/layers/quantization/turboquant/centroids.py"
CONFIG = "vllm/model_executor/layers/quantization/turboquant/config.py"
BACKEND = "vllm/v1/attention/backends/turboquant_attn.py"
MEMBERS = (STORE, CENTROIDS, CONFIG, BACKEND)
# The paged buffer: block 0 is the null block; heads and tokens as in a small GQA layer.
NUM_BLOCKS, BLOCK_SIZE, HEADS, TOKENS, PADDING = 6, 16, 4, 48, 8


class ParityError(Exception):
    """vLLM could not be fetched or loaded: reported as one ``error:`` line."""


# -- fetching and loading vLLM ----------------------------------------------------------------
def cache_root() -> Path:
    """Where wheels and unpacked sources are kept (``TQEXPORT_CACHE`` overrides)."""
    base = os.environ.get("TQEXPORT_CACHE") or Path.home() / ".cache" / "tqexport"
    return Path(base) / "vllm"


def fetch_wheel(version: str, dest: Path) -> Path:
    """vLLM's wheel in ``dest``, downloaded (never installed) unless it is already there."""
    found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:",
           "--platform", "manylinux_2_28_x86_64", "--retries", "2", "--timeout", "60",
           f"vllm=={version}", "-d", str(dest)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if r.returncode or not found:
        lines = [x for x in (r.stderr or r.stdout).splitlines() if x.strip()]
        why = lines[-1].strip() if lines else f"pip exited {r.returncode}"
        raise ParityError(f"could not download vllm=={version} with pip: {why}")
    return found[0]


def unpack(wheel: Path, dest: Path) -> Path:
    """Extract only the TurboQuant modules from the wheel into ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            missing = [m for m in MEMBERS if m not in names]
            if missing:
                raise ParityError(f"{wheel.name} has no {missing[0]} (did TurboQuant move?)")
            for m in MEMBERS:
                z.extract(m, dest)
    except zipfile.BadZipFile as e:
        raise ParityError(f"{wheel} is not a readable wheel ({e}); delete it and rerun") from None
    return dest


def _package(name: str, **attrs) -> types.ModuleType:
    """A stub package (or module) in ``sys.modules``."""
    mod = types.ModuleType(name)
    mod.__path__ = []
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _load(name: str, path: Path) -> types.ModuleType:
    """Import one vLLM source file under its own module name."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # a newer vLLM importing more than the stubs provide
        raise ParityError(f"cannot load vLLM's {path.name} with the stubs: {e}") from None
    return mod


def _hadamard_builder(path: Path):
    """vLLM's ``_build_hadamard_cached`` taken from its backend source (the rest is skipped)."""
    tree = ast.parse(path.read_text())
    name = "_build_hadamard_cached"
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        raise ParityError(f"{BACKEND} has no _build_hadamard_cached (did it move?)")
    fn.decorator_list = []
    scope = {"torch": torch, "math": math}
    exec(compile(ast.Module([fn], []), str(path), "exec"), scope)  # noqa: S102
    return scope[fn.name]


@dataclass
class Vllm:
    """The loaded vLLM pieces: store launcher, preset configs, centroids, rotation."""

    store: object
    config: object
    centroids: object
    hadamard: object


def load_vllm(root: Path) -> Vllm:
    """Load vLLM's TurboQuant modules with a fake ``vllm`` package providing only their imports."""
    import triton
    import triton.language as tl

    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops",
                 "vllm.model_executor", "vllm.model_executor.layers",
                 "vllm.model_executor.layers.quantization",
                 "vllm.model_executor.layers.quantization.turboquant"):  # fmt: skip
        _package(name)
    _package("vllm.triton_utils", triton=triton, tl=tl)
    # 0 = fp8e4nv keys (GPUs of compute capability >= 8.9); tqexport writes e4m3 like them.
    _package("vllm.v1.attention.ops.triton_turboquant_decode", _use_fp8_e4b15=lambda device=0: 0)
    qt = "vllm.model_executor.layers.quantization.turboquant"
    config = _load(f"{qt}.config", root / CONFIG)
    centroids = _load(f"{qt}.centroids", root / CENTROIDS)
    store = _load("vllm.v1.attention.ops.triton_turboquant_store", root / STORE)
    return Vllm(store, config, centroids, _hadamard_builder(root / BACKEND))


def use_gpu_fp8_cast() -> None:
    """Give the interpreter the GPU's fp32 -> fp8e4nv cast, ``cvt.rn.satfinite.e4m3x2.f32``
    (nearest even, overflow and +-inf to +-448, NaN to 0x7F). Triton's interpreter rounds ties
    away from zero, drops the carry into the next binade and does not saturate."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = ti.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.float8e4nv:
            return original(self, src, dst_type, rounding_mode)
        x = torch.from_numpy(np.array(src.data, dtype=np.float32))
        bits = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        return ti.TensorHandle(torch.where(x.isnan(), 0x7F, bits).numpy(), dst_type.scalar)

    ti.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


# -- inputs -----------------------------------------------------------------------------------
def unit_with(values: torch.Tensor, d: int) -> torch.Tensor:
    """A unit [D] vector starting with ``values``; the next coordinate completes the norm."""
    y = torch.zeros(d)
    y[: values.numel()] = values
    y[values.numel()] = (1 - values.square().sum()).sqrt()
    return y


def edge_vectors(d: int, thresholds: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    """[E, D] vectors that stress every rounding and special-value path of the store."""
    g = torch.Generator().manual_seed(1000 + d)
    r = torch.randn(d, generator=g)
    j = torch.arange(d, dtype=torch.float32)
    nan, inf = float("nan"), float("inf")
    fp8_ties = torch.tensor([1.0625, -1.1875, 0.0029296875, 2.0**-10, 464.0, -500.0, 240.0, 3.25])
    rows = [
        torch.zeros(d),  # zero norm, zero range
        torch.full((d,), -0.0),
        r * 1e-30,  # squares underflow: norm 0
        r * 1e-40,  # fp32 subnormals
        r * 1e-6,  # fp16 subnormal norm, scale and zero
        r * 1e20,  # squares overflow: norm inf; fp16 overflow of norm, scale and zero
        torch.where(j % 2 == 0, 65504.0, 65520.0),  # fp16 max and its rounding threshold
        torch.full((d,), 3.0),  # constant: range 0, scale 1e-8
        (j % 16) + 0.5,  # value codes exactly halfway between two levels (scale 1)
        torch.where(j % 2 == 0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11),  # fp16 ties to even
        fp8_ties.repeat(d // 8),  # e4m3 ties, subnormals, saturation
        # keys whose rotated unit vector sits on the key thresholds, and one ulp either side
        3 * unit_with(thresholds, d) @ hadamard,
        3 * unit_with(thresholds.nextafter(torch.tensor(inf)), d) @ hadamard,
        3 * unit_with(thresholds.nextafter(torch.tensor(-inf)), d) @ hadamard,
        r.index_fill(0, torch.tensor([3]), nan),
        torch.full((d,), nan),
        r.index_fill(0, torch.tensor([5]), inf),
        r.index_fill(0, torch.tensor([0]), -inf),
        r.index_fill(0, torch.tensor([1]), inf).index_fill(0, torch.tensor([2]), -inf),
        torch.full((d,), inf),
        torch.full((d,), -inf),
    ]
    return torch.stack(rows)


def make_inputs(d: int, thresholds: torch.Tensor, hadamard: torch.Tensor):
    """K, V ``[T, H, D]``: random heads, every edge vector as a key, as a value and as both in
    real tokens; a slot mapping with padding (-1) tokens, real ones scattered over blocks 1.."""
    g = torch.Generator().manual_seed(d)
    k = torch.randn(TOKENS, HEADS, d, generator=g) * 3
    v = torch.randn(TOKENS, HEADS, d, generator=g)
    padding = torch.randperm(TOKENS, generator=g) < PADDING
    real = torch.randperm((NUM_BLOCKS - 1) * BLOCK_SIZE, generator=g)[:TOKENS] + BLOCK_SIZE
    slots = torch.where(padding, torch.full_like(real, -1), real)
    edges = edge_vectors(d, thresholds, hadamard)
    n = edges.shape[0]
    rows = (~padding).repeat_interleave(HEADS).nonzero().flatten()  # rows of real tokens
    k.view(-1, d)[torch.cat([rows[:n], rows[2 * n : 3 * n]])] = torch.cat([edges, edges])
    v.view(-1, d)[rows[n : 3 * n]] = torch.cat([edges, edges.flip(0)])
    return k, v, slots


# -- the comparison ---------------------------------------------------------------------------
def vllm_write(vl: Vllm, name: str, cache: torch.Tensor, k, v, slots) -> torch.Tensor:
    """vLLM's store kernel (interpreted) into a copy of ``cache``."""
    import numpy as np

    cfg = vl.config.TurboQuantConfig.from_cache_dtype(name, k.shape[-1])
    cents = vl.centroids.get_centroids(cfg.head_dim, cfg.centroid_bits).float()
    c_sorted, _ = cents.sort()
    midpoints = (c_sorted[:-1] + c_sorted[1:]) / 2  # as TurboQuantAttentionImpl derives them
    out = cache.clone()
    # NaN/inf inputs make numpy warn inside the interpreter (All-NaN slice, invalid cast)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        vl.store.triton_turboquant_store(
            k, v, out, slots.to(torch.int32), vl.hadamard(cfg.head_dim, "cpu"), midpoints,
            mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
        )  # fmt: skip
    return out


def tqexport_write(name: str, cache: torch.Tensor, k, v, slots) -> torch.Tensor:
    """tqexport's reference cache write into a copy of ``cache``."""
    from tqexport.kvquant.codecs import make_codec
    from tqexport.ops.reference import write_cache

    codec = make_codec(name, k.shape[-1], model_dtype="float32")
    return write_cache(codec, [cache.clone()], k, v, slots.to(torch.int64))[0]


@dataclass
class Row:
    preset: str
    head_size: int
    slots: int
    compared: int
    differing: int
    first: str


def compare(vl: Vllm, name: str, d: int) -> Row:
    """Both writers on the same inputs and pre-filled buffer; blocks 1.. compared bytewise."""
    from tqexport.kvquant import turboquant as tq

    lay = tq.slot_layout(name, d)
    th = tq.thresholds(tq.centroids(d, 4 if lay.preset.key_fp8 else lay.preset.key_bits))
    k, v, slots = make_inputs(d, th, tq.hadamard(d))
    g = torch.Generator().manual_seed(7 * d)
    shape = (NUM_BLOCKS, BLOCK_SIZE, HEADS, lay.slot_size_aligned)
    cache = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    theirs = vllm_write(vl, name, cache, k, v, slots)[1:]
    ours = tqexport_write(name, cache, k, v, slots)[1:]
    diff = theirs != ours
    written = int((slots >= 0).sum()) * HEADS
    return Row(name, d, written, diff.numel(), int(diff.sum()), first_diff(diff, theirs, ours))


def first_diff(diff: torch.Tensor, theirs: torch.Tensor, ours: torch.Tensor) -> str:
    """Where the first differing byte is, with both values, or ''."""
    hits = diff.nonzero()
    if not hits.numel():
        return ""
    b, o, h, x = hits[0].tolist()
    return (f"block {b + 1}, offset {o}, head {h}, byte {x}: vLLM {theirs[b, o, h, x]:#04x}, "
            f"tqexport {ours[b, o, h, x]:#04x}")  # fmt: skip


def report(rows: list[Row], version: str, gpu_fp8: bool) -> None:
    """The table, then the first difference of every failing row."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"TurboQuant slot bytes: vLLM {version} store kernel vs tqexport")
    table.add_column("preset")
    for col in ("D", "slots written", "bytes compared", "bytes differing"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.preset, str(r.head_size), str(r.slots), str(r.compared),
                      str(r.differing), style="red" if r.differing else None)  # fmt: skip
    Console(highlight=False).print(table)
    print(f"buffer: {NUM_BLOCKS} blocks x {BLOCK_SIZE} positions x {HEADS} heads; {TOKENS} tokens, "
          f"{PADDING} of them padding (slot -1)")  # fmt: skip
    cast = "the GPU's (cvt.rn.satfinite)" if gpu_fp8 else "the interpreter's own"
    print(f"compared: every byte of blocks 1..{NUM_BLOCKS - 1} (0 is the null block); fp8: {cast}")
    for r in rows:
        if r.differing:
            print(f"{r.preset} D={r.head_size}: first difference at {r.first}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-version", default=VLLM_VERSION)
    ap.add_argument("--interpreter-fp8", action="store_true",
                    help="keep the Triton interpreter's own fp8 cast (not the GPU's)")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.interpreter_fp8:
        use_gpu_fp8_cast()
    try:
        root = cache_root()
        wheel = fetch_wheel(args.vllm_version, root / "wheels")
        vl = load_vllm(unpack(wheel, root / f"src-{args.vllm_version}"))
    except ParityError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [compare(vl, name, d) for name in PRESETS for d in HEAD_SIZES]
    report(rows, args.vllm_version, not args.interpreter_fp8)
    bad = sum(r.differing for r in rows)
    print(f"{'FAIL' if bad else 'ok'}: {bad} differing bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
