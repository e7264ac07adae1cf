"""``tqexport serve``: an artifact behind OpenAI's HTTP API, here or on Ray Serve."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tqexport import validate
from tqexport.cli.common import ENGINE, given_names
from tqexport.console import warn
from tqexport.options import EngineOptions, KernelsOption, MemoryOptions
from tqexport.runtime.engine_config import EngineConfig


def serve(
    ctx: typer.Context,
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    host: Annotated[
        str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free one).")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model name clients send (default: ARTIFACT).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="TQEXPORT_API_KEY",
            show_envvar=False,
            help="Require 'Authorization: Bearer KEY' on every route but /health (or set "
            "TQEXPORT_API_KEY).",
        ),
    ] = None,
    metrics_public: Annotated[
        bool,
        typer.Option(
            "--metrics-public",
            help="With --api-key: leave /metrics open (a Prometheus scraper without the key).",
        ),
    ] = False,
    backend: EngineOptions[0] = ENGINE.backend,
    num_blocks: MemoryOptions[0] = ENGINE.num_blocks,
    kv_cache_memory: MemoryOptions[1] = ENGINE.kv_cache_memory,
    max_model_len: MemoryOptions[2] = ENGINE.max_model_len,
    max_num_batched_tokens: EngineOptions[1] = ENGINE.max_num_batched_tokens,
    max_num_seqs: EngineOptions[2] = ENGINE.max_num_seqs,
    threads: EngineOptions[3] = ENGINE.threads,
    chat_template: EngineOptions[4] = ENGINE.chat_template,
    long_prefill_token_threshold: EngineOptions[5] = ENGINE.long_prefill_token_threshold,
    kernels: KernelsOption = ENGINE.kernels,
    grace_seconds: Annotated[
        float, typer.Option(help="After SIGTERM, seconds in-flight requests may take to finish.")
    ] = 30.0,
    ray: Annotated[
        bool, typer.Option("--ray", help="Serve as a Ray Serve deployment (scale-out).")
    ] = False,
    replicas: Annotated[
        int, typer.Option(help="With --ray: replicas, each with its own engine and caches.")
    ] = 1,
    ray_address: Annotated[
        str | None,
        typer.Option(help="With --ray: join this cluster (e.g. HEAD:6379) instead of a local one."),
    ] = None,
    replica_cpus: Annotated[
        float, typer.Option(help="With --ray: CPUs Ray reserves for each replica.")
    ] = 1.0,
    max_replicas_per_node: Annotated[
        int | None,
        typer.Option(help="With --ray: most replicas Ray places on one node (default: no limit)."),
    ] = None,
):
    """Serve an artifact over OpenAI's HTTP API: /v1/completions, /v1/chat/completions
    (streamed or whole), /v1/models, /health, /metrics; SIGTERM drains and exits 0."""
    validate.serve_options(api_key, metrics_public, port, grace_seconds, replicas, replica_cpus,
                           max_replicas_per_node, ray, given_names(ctx))  # fmt: skip
    config = EngineConfig(
        backend, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens, threads,
        chat_template, kernels, max_model_len, long_prefill_token_threshold,
    )  # fmt: skip
    if ray:
        from tqexport.contract.artifact import open_artifact
        from tqexport.runtime.engine import limit_fallback_note
        from tqexport.serve.ray_serve import serve_on_ray

        note = limit_fallback_note(open_artifact(artifact), max_model_len)  # a bad artifact
        if note:  # fails here, not in every replica
            warn(note)
        name = served_model_name or str(artifact)
        serve_on_ray(artifact, config, host, port, name, api_key, replicas, ray_address,
                     replica_cpus, grace_seconds, metrics_public,
                     max_replicas_per_node)  # fmt: skip
        return
    from tqexport.serve.runner import serve as run_server

    run_server(artifact, config, host, port, served_model_name, api_key, grace_seconds,
               metrics_public=metrics_public)  # fmt: skip
