"""ONNX Runtime session options of the systems a peer-speed run compares: ONNX Runtime GenAI's,
from its ``genai_config.json`` and the defaults GenAI and ORT fill in, set beside tqexport's
(:func:`tqexport.runtime.backends.ort.session_summary`), and how they differ."""

from __future__ import annotations

import copy

#: the ORT config entry saying whether idle intra-op threads spin ("0": they sleep)
SPINNING_ENTRY = "session.intra_op.allow_spinning"
#: ORT's value of each summarized option that no one sets
ORT_DEFAULTS = {
    "inter_op_num_threads": 0,
    "execution_mode": "ORT_SEQUENTIAL",
    "graph_optimization_level": "ORT_ENABLE_ALL",
    "enable_mem_pattern": True,
    "enable_cpu_mem_arena": True,
    "allow_spinning": True,
}
#: where a GenAI option's value came from
FROM_CONFIG, FROM_GENAI, FROM_ORT = "genai_config.json", "GenAI's default", "ORT's default"


def genai_system(precision: str) -> str:
    """A GenAI model's system name in a peers run, by its builder precision."""
    return f"ORT GenAI {precision}"


#: the GenAI model a peers run compares with unless told otherwise: GenAI's fp32 model
GENAI = genai_system("fp32")


def genai_default_threads(cpus: int) -> int:
    """GenAI's intra-op threads when its config sets none: half the hardware threads, 1 to 16."""
    return min(max(1, cpus // 2), 16)


def genai_overlay(threads: int | None, spinning: bool | None) -> dict:
    """The ``genai_config.json`` overlay setting the decoder session's intra-op threads and
    spinning (None leaves GenAI's own); GenAI passes unknown session keys to ORT as config
    entries (versions that do not refuse the overlay)."""
    so: dict = {}
    if threads:
        so["intra_op_num_threads"] = threads
    if spinning is not None:
        so[SPINNING_ENTRY] = "1" if spinning else "0"
    return {"model": {"decoder": {"session_options": so}}} if so else {}


def merged(config: dict, overlay: dict) -> dict:
    """``config`` with ``overlay`` laid over it (nested keys merged, the overlay's win)."""
    out = copy.deepcopy(config)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def genai_session(config: dict, cpus: int) -> dict:
    """GenAI's decoder session options as :func:`session_summary` names them, from ``config``
    (``genai_config.json`` with any overlay merged), else GenAI's thread default on ``cpus``
    hardware threads, else ORT's defaults; ``set_by`` says which, per option."""
    so = config["model"]["decoder"].get("session_options") or {}
    options, set_by = {}, {}
    if "intra_op_num_threads" in so:
        options["intra_op_num_threads"], set_by["intra_op_num_threads"] = (
            so["intra_op_num_threads"], FROM_CONFIG
        )  # fmt: skip
    else:
        options["intra_op_num_threads"] = genai_default_threads(cpus)
        set_by["intra_op_num_threads"] = FROM_GENAI
    for key, default in ORT_DEFAULTS.items():
        if key == "allow_spinning":
            value = so.get(SPINNING_ENTRY)
            options[key] = default if value is None else str(value) != "0"
            set_by[key] = FROM_ORT if value is None else FROM_CONFIG
        else:
            options[key] = so.get(key, default)
            set_by[key] = FROM_CONFIG if key in so else FROM_ORT
    return {**options, "set_by": set_by}


def differences(ours: dict, theirs: dict, names: tuple[str, str] = ("tqexport", "GenAI")):
    """One line per option the two sessions set differently (``set_by`` and options only one
    of them names aside)."""
    return [
        f"{key}: {names[0]} {ours[key]}, {names[1]} {theirs[key]}"
        for key in ours
        if key != "set_by" and key in theirs and ours[key] != theirs[key]
    ]
