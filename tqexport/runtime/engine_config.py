"""Every serving setting in one object: the engine, ``run``, ``inspect`` and ``serve`` share it.

Nothing here imports torch, so the command line can take its option defaults from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqexport import validate
from tqexport.errors import TQExportError
from tqexport.native import KERNEL_CHOICES


@dataclass(frozen=True)
class EngineConfig:
    """Every serving setting, checked when made; the command line takes its defaults from here.

    ``num_blocks`` or ``kv_cache_memory`` sizes the caches (neither:
    ``validate.DEFAULT_KV_CACHE_MEMORY``);
    ``threads`` is ONNX Runtime's intra-op thread count (None: its default)."""

    backend: str = "ort"
    num_blocks: int | None = None
    kv_cache_memory: str | None = None
    max_num_seqs: int = validate.DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = validate.DEFAULT_MAX_NUM_BATCHED_TOKENS
    threads: int | None = None
    chat_template: bool = True
    #: what runs the attention/cache ops on ONNX Runtime's CPU provider (auto: the native
    #: kernels where they serve the artifact, else the function bodies)
    kernels: str = "auto"
    #: the longest sequence (prompt + output) served, vLLM's ``--max-model-len``; the memory plan
    #: is split for it (None: the model's position limit)
    max_model_len: int | None = None
    #: prompt tokens per step while sequences decode, so a long prompt stalls them less
    #: (0: off; ``runtime.scheduler.Scheduler``)
    long_prefill_token_threshold: int = validate.DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD

    def __post_init__(self):
        validate.serving(
            self.num_blocks, self.max_num_seqs, self.max_num_batched_tokens, self.backend,
            self.long_prefill_token_threshold,
        )  # fmt: skip
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise TQExportError("give --num-blocks or --kv-cache-memory, not both")
        if self.kv_cache_memory is not None:
            validate.parse_memory(self.kv_cache_memory)
        if self.threads is not None:
            validate.threads(self.threads)
            if self.backend != "ort":
                raise TQExportError(
                    f"--threads sets ONNX Runtime's threads and has no effect with --backend "
                    f"{self.backend}; drop it"
                )
        validate.choice(self.kernels, "--kernels", KERNEL_CHOICES)
        if self.max_model_len is not None:
            validate.integer(self.max_model_len, "--max-model-len", 1)
        if self.kernels != "auto" and self.backend != "ort":
            raise TQExportError(
                f"--kernels {self.kernels} chooses ONNX Runtime's kernels; --backend "
                f"{self.backend} does not run them (drop one of the two)"
            )
        if not isinstance(self.chat_template, bool):
            raise TQExportError(f"chat_template must be True or False, got {self.chat_template!r}")

    @property
    def memory(self) -> str | None:
        """The KV budget in effect (None when ``num_blocks`` sizes the caches)."""
        if self.num_blocks is not None:
            return None
        return self.kv_cache_memory or validate.DEFAULT_KV_CACHE_MEMORY

    def group_blocks(
        self, artifact, memory_limit: int | None = None, context: int | None = None
    ) -> list[int]:
        """Blocks per cache group these settings give ``artifact`` (what ``inspect`` prints);
        ``memory_limit``: bytes the caches may take at most; ``context``: the longest sequence
        served (``engine.context_limit``), which a budget is split for."""
        from tqexport.runtime.memory import resolve_num_blocks

        return resolve_num_blocks(
            artifact,
            self.num_blocks,
            self.memory,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            memory_limit=memory_limit,
            context=context,
        )
