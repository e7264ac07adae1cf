"""What a ``tqexport bench`` run covers and how it gets there: the configurations scored, the
artifacts built or reused per dtype, the peers run, each input checked before anything runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tqexport import validate
from tqexport.errors import TQExportError
from tqexport.spec import BuildRequest, parse_kv_scales
from tqexport.spec.request import DEFAULT_WEIGHTS

#: every kv dtype a quality run covers by default (aliases and 16-bit stores left out)
BENCH_DTYPES = (
    "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head",
    "nvfp4", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
    "tqx_k4v4_g32", "tqx_k4v3_g32", "tqx_k4v3_mse", "tqx_k4v2_mse",
)  # fmt: skip
BENCH_SPEED_DTYPES = ("auto", "fp8", "turboquant_4bit_nc")
#: bench sizes: quality windows, decode contexts, batches and timed steps
MAX_BENCH_CHUNK, MAX_BENCH_CHUNKS = 2**17, 10**5
MAX_BENCH_CONTEXT, MAX_BENCH_BATCH, MAX_BENCH_STEPS = 2**20, 4096, 10**4

Say = Callable[[str], None]


def split(values: list[str] | None, name: str) -> list[str]:
    """Repeated and comma-separated values of option ``name``, flattened (none empty)."""
    return [x for v in values or [] for x in validate.comma_list(v, name)]


def ints(text: str, what: str, minimum: int = 1, maximum: int | None = None) -> list[int]:
    """'256,1024' -> [256, 1024]; ``what`` names the option in the error."""
    parts = validate.comma_list(text, f"--{what}")
    try:
        values = [int(x) for x in parts]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        kind = "positive integers" if minimum == 1 else f"integers >= {minimum}"
        raise TQExportError(f"--{what} must be {kind} separated by commas, got {text!r}")
    if maximum is not None and max(values) > maximum:
        raise TQExportError(f"--{what} values must be at most {maximum}, got {max(values)}")
    return values


def quality_configs(
    dtypes: list[str] | None,
    boundary: str,
    skip_layers: list[str] | None,
    recent: str = "0",
    kv_scales: str = "1.0",
    key_transforms: str = "none",
    sinks: str = "0",
    kv_layers: list[str] | None = None,
):
    """The configurations a quality run scores: every dtype, TurboQuant ones with boundary
    protection on/off as asked, quantized ones at every recent window (those > 0 with every
    count of sink tokens in ``sinks``), native TurboQuant ones with every key transform in the
    comma-separated ``key_transforms``. Each of ``kv_layers`` (one ``--kv-layers`` value each)
    is one configuration instead, its left-out layers at the one ``--kv-cache-dtype`` (auto)."""
    from tqexport.bench.quality import Config
    from tqexport.kvquant.modes import parse_kv_cache_dtype
    from tqexport.kvquant.transforms import key_transform_label, parse_key_transform

    if boundary not in ("on", "off", "both"):
        raise TQExportError(f"--boundary must be on, off or both, got {boundary!r}")
    parse_kv_scales(kv_scales)
    names = split(dtypes, "--kv-cache-dtype") or list(BENCH_DTYPES)
    entries = [parse_kv_cache_dtype(n) for n in names]
    skip = tuple(split(skip_layers, "--skip-layers"))
    windows = ints(recent, "recent-window", minimum=0, maximum=validate.MAX_RECENT_WINDOW)
    sink_counts = ints(sinks, "kv-sink-tokens", minimum=0, maximum=validate.MAX_SINK_TOKENS)
    if any(sink_counts) and not any(windows):
        raise TQExportError(
            "--kv-sink-tokens needs a --recent-window value >= 1: the sink tokens are kept in "
            "the recent-window cache"
        )
    transforms = [
        key_transform_label(parse_key_transform(t))
        for t in split([key_transforms], "--kv-key-transform")
    ]
    if kv_layers:
        return _layer_configs(kv_layers, dtypes, boundary, skip, windows, sink_counts,
                              kv_scales, transforms)  # fmt: skip
    _no_effect(names, entries, boundary, kv_scales, transforms, windows)
    configs = []
    for n in names:
        entry = parse_kv_cache_dtype(n)
        flags = {"on": [True], "off": [False], "both": [True, False]}[boundary]
        keys = transforms if entry.takes_key_transform else ["none"]
        for b in flags if entry.is_turboquant else [True]:
            configs += [
                Config(
                    BuildRequest(
                        n,
                        skip,
                        b,
                        recent_window=w,
                        sink_tokens=s,
                        kv_scales=kv_scales,
                        key_transform=t,
                    )
                )  # fmt: skip
                for w in (windows if entry.mode.is_quantized else [0])
                for s in (sink_counts if w else [0])
                for t in keys
            ]
    return configs


def _layer_configs(kv_layers, dtypes, boundary, skip, windows, sink_counts, kv_scales, transforms):
    """One configuration per ``--kv-layers`` value (and global window, sinks, key transform);
    the one ``--kv-cache-dtype`` given, else auto, is what the layers left out get."""
    from tqexport.bench.quality import Config
    from tqexport.spec.kv_layers import parse_kv_layers

    names = split(dtypes, "--kv-cache-dtype") or ["auto"]
    if len(names) > 1:
        raise TQExportError(
            f"--kv-layers takes one --kv-cache-dtype (what the layers it leaves out get), got "
            f"{','.join(names)}; give one"
        )
    for spec in kv_layers:
        parse_kv_layers(spec)
    fixed = dict(skip_layers=skip, kv_scales=kv_scales, boundary=boundary != "off")
    return [
        Config(
            BuildRequest(
                names[0], recent_window=w, sink_tokens=s, key_transform=t, kv_layers=spec, **fixed
            )
        )  # fmt: skip
        for spec in kv_layers
        for w in windows
        for s in (sink_counts if w else [0])
        for t in transforms
    ]


def _no_effect(names, entries, boundary, kv_scales, transforms, windows) -> None:
    """Refuse an option that no dtype of the run uses (it would be ignored)."""
    dtypes = f"--kv-cache-dtype {','.join(names)}"
    if any(windows) and not any(e.mode.is_quantized for e in entries):
        raise TQExportError(
            f"--recent-window {','.join(map(str, windows))} has no effect: {dtypes} has no "
            "quantized dtype; drop it"
        )
    if boundary != "both" and not any(e.is_turboquant for e in entries):
        raise TQExportError(
            f"--boundary {boundary} has no effect: {dtypes} has no TurboQuant dtype; drop it"
        )
    if kv_scales != "1.0" and not any(e.mode.uses_layer_scales for e in entries):
        raise TQExportError(
            f"--kv-scales {kv_scales} has no effect: {dtypes} has no fp8/nvfp4 dtype; drop it"
        )
    if transforms != ["none"] and not any(e.takes_key_transform for e in entries):
        raise TQExportError(
            f"--kv-key-transform {','.join(transforms)} has no effect: {dtypes} has no "
            "tqexport-native TurboQuant dtype (tqx_*); drop it"
        )


def run_quality(
    target,
    configs,
    text_file,
    chunk,
    chunks,
    peer: bool,
    progress,
    say: Say,
    threads=None,
    weights=DEFAULT_WEIGHTS,
):
    """Ours, then the llama.cpp peer when asked and possible: (ours, peer result, peer note)."""
    from tqexport.bench import evaltext, peers, quality

    text = evaltext.file_text(text_file) if text_file else evaltext.pydoc_topics()
    ours, ids = quality.evaluate(
        target, configs, text, chunk, chunks, progress=progress, weights=weights
    )
    peer_result, note = None, None
    source = ours["model"]
    gguf = peers.gguf_path(source)
    if not peer:
        note = "not run (--no-peer)"
    elif gguf is None:
        note = f"not run: llama.cpp needs a GGUF model, {source} is not one"
    elif not peers.available():
        note = "not run: llama-cpp-python is not installed (pip install -e '.[peers]')"
    else:
        say(f"llama.cpp: scoring {len(ids)} chunks (f16, q8_0, q4_0)")
        from tqexport.kvplan.storage_bits import held_share
        from tqexport.models.config import describe_model

        share = float(held_share(describe_model(source).layers))
        peer_result = peers.evaluate(gguf, ids, threads=threads, held_share=share)
    return ours, peer_result, note


def speed_args(contexts: str, batches: str, steps: int, recent: str):
    """The decode grid (contexts, batches, recent windows), checked."""
    ctx = ints(contexts, "contexts", maximum=MAX_BENCH_CONTEXT)
    bat = ints(batches, "batches", maximum=MAX_BENCH_BATCH)
    windows = ints(recent, "recent-window", minimum=0, maximum=validate.MAX_RECENT_WINDOW)
    validate.integer(steps, "--steps", 1, MAX_BENCH_STEPS)
    return ctx, bat, windows


def check_speed_memory(spec, label: str, ctx: list[int], bat: list[int], steps: int) -> None:
    """The largest decode point's caches must fit in this machine's memory."""
    from tqexport.console import fmt_bytes

    tokens = max(bat) * (max(ctx) + steps + 2 * spec.block_size)
    need = tokens * (spec.bytes_per_token + spec.recent_bytes_per_token)
    limit = validate.physical_memory()
    if limit is not None and need > limit:
        raise TQExportError(
            f"{label}: context {max(ctx)} x batch {max(bat)} needs {fmt_bytes(need)} of KV "
            f"cache, more than this machine's {fmt_bytes(limit)}; lower --contexts or --batches"
        )


def is_artifact(target) -> bool:
    """Whether a bench TARGET is an artifact directory (else a model to build artifacts of)."""
    from tqexport.contract.files import SPEC_FILE

    return Path(target).is_dir() and (Path(target) / SPEC_FILE).is_file()


def speed_artifacts(
    target, dtypes, windows: list[int], weights, workdir: Path, check: Callable | None = None
) -> tuple[dict, Callable[[Say], dict]]:
    """(label -> spec, ``build(say)`` -> label -> artifact) of a speed run: ``target`` a model,
    whose artifacts per dtype (quantized ones per recent window) are built or reused under
    ``workdir`` with ``--weights weights``, or one artifact (beside auto on its own weights).
    Every name is checked, and ``check(spec, label)`` run on each spec, before anything is
    built."""
    from tqexport.bench import speed
    from tqexport.contract.artifact import open_artifact
    from tqexport.kvquant.modes import parse_kv_cache_dtype

    check = check or (lambda spec, label: None)
    if is_artifact(target):
        from tqexport.bench.quality import Config

        art = open_artifact(target)
        check(art.spec, str(target))
        request = art.spec.request or BuildRequest()
        # named as bench quality names it: a --kv-bits or --kv-layers plan is not "auto"
        name = Config(request).label

        def build_one(say: Say) -> dict:
            auto = speed.artifact_for(art.spec.model["path"], "auto", workdir,
                                      weights=request.weights)  # fmt: skip
            return {"auto": auto, name: art}

        return {name: art.spec}, build_one
    from tqexport.kvplan.resolve import resolve
    from tqexport.models.config import describe_model

    given = split(dtypes, "--kv-cache-dtype") or BENCH_SPEED_DTYPES
    names = ["auto", *[n for n in given if n != "auto"]]
    for n in names:  # every name and combination first: nothing is built for a typo
        parse_kv_cache_dtype(n)
    desc = describe_model(target)
    plans, specs = {}, {}
    for n in names:
        for w in windows if parse_kv_cache_dtype(n).mode.is_quantized else [0]:
            label = f"{n} recent {w}" if w else n
            plans[label] = (n, w)
            request = BuildRequest(n, recent_window=w, weights=weights)
            specs[label] = resolve(desc, request).spec
            check(specs[label], label)

    def build(say: Say) -> dict:
        arts = {}
        for label, (n, w) in plans.items():
            say(f"artifact {label}: building or reusing under {workdir}")
            arts[label] = speed.artifact_for(target, n, workdir, w, weights)
        return arts

    return specs, build


def plan_speed(target, dtypes, contexts, batches, steps, budget, workdir, recent="0",
               kernels="auto", weights=DEFAULT_WEIGHTS) -> Callable[[Say], dict]:  # fmt: skip
    """Every input of a speed run checked (dtypes, grid, budget, memory, kernel choices) before
    anything is built or run; returns the run: ``run(say)`` builds or reuses the artifacts
    (:func:`speed_artifacts`) and measures them."""
    from tqexport.bench import speed
    from tqexport.validate import parse_memory

    ctx, bat, windows = speed_args(contexts, batches, steps, recent)
    parse_memory(budget, "--budget")
    asked = speed.parse_kernels(kernels)
    specs, build = speed_artifacts(
        target, dtypes, windows, weights, workdir,
        lambda spec, label: check_speed_memory(spec, label, ctx, bat, steps),
    )  # fmt: skip
    speed.run_kernels(asked, specs)

    def run(say: Say) -> dict:
        arts = build(say)
        chosen = speed.run_kernels(asked, {n: a.spec for n, a in arts.items()})
        say(f"kernels: {', '.join(chosen)} (asked: {', '.join(asked)})")
        from tqexport.weights.precision import stored_label

        result = speed.measure(arts, ctx, bat, steps, budget, progress=say, kernels=chosen)
        weights = {n: stored_label(a.spec) for n, a in arts.items()}
        return {**result, "kernels_requested": asked, "weights": weights}

    return run


def run_speed(target, dtypes, contexts, batches, steps, budget, workdir, say: Say, recent="0",
              kernels="auto", weights=DEFAULT_WEIGHTS):  # fmt: skip
    """Decode speed and KV memory per dtype (and recent window) under each kernel choice:
    :func:`plan_speed`, then its run."""
    return plan_speed(target, dtypes, contexts, batches, steps, budget, workdir, recent,
                      kernels, weights)(say)  # fmt: skip
