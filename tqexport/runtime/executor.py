"""The serving loop: schedule, build the step, run it on a backend, sample, stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tqexport import validate
from tqexport.contract.artifact import Artifact
from tqexport.contract.steps import SeqChunk, build_step
from tqexport.errors import TQExportError
from tqexport.runtime.blocks import BlockManager
from tqexport.runtime.memory import resolve_num_blocks
from tqexport.runtime.sampling import sample
from tqexport.runtime.scheduler import Scheduler
from tqexport.runtime.sequence import SamplingParams, Sequence


def limit_words(limit_name: str) -> str:
    """How messages name the sequence length limit that ``limit_name`` sets."""
    if limit_name == "max_position_embeddings":
        return "the model's position limit"
    return f"the {limit_name} limit"


@dataclass
class StepEvent:
    seq: Sequence
    token: int


class Executor:
    def __init__(
        self,
        artifact: Artifact,
        backend: str = "ort",
        num_blocks: int | None = None,
        kv_cache_memory: str | None = None,
        max_num_batched_tokens: int = validate.DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs: int = validate.DEFAULT_MAX_NUM_SEQS,
        long_prefill_token_threshold: int = validate.DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
        threads: int | None = None,
        source_model=None,
        max_model_len: int | None = None,
        kernels: str = "auto",
        limit_name: str = "max_position_embeddings",
    ):
        """``source_model``: the torch backend's already loaded model (skips reloading it).
        ``max_model_len``: the model's position limit; a request whose prompt plus max_tokens
        exceeds it is rejected (finished with a "rejected: ..." reason, never run), and a memory
        budget is split for sequences of that length (``memory.resolve_num_blocks``);
        ``limit_name``: what set it, named in rejections (or ``--max-model-len``)."""
        self.artifact = artifact
        self.spec = artifact.spec
        validate.choice(backend, "backend", ("ort", "torch", "trt"))
        if threads is not None:
            validate.threads(threads, "threads")
        if max_model_len is not None:
            validate.integer(max_model_len, "max_model_len", 1)
        validate.integer(long_prefill_token_threshold, "long_prefill_token_threshold", 0,
                         validate.MAX_NUM_BATCHED_TOKENS)  # fmt: skip
        self.max_model_len = max_model_len
        self.limit_name = limit_name
        #: blocks per cache group; the layers' own caches have ``num_blocks``
        self.group_num_blocks = resolve_num_blocks(
            artifact, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
            memory_limit=validate.physical_memory(), context=max_model_len,
        )  # fmt: skip
        self.num_blocks = max(self.group_num_blocks)
        if backend == "ort":
            from tqexport.runtime.backends.ort import OrtBackend

            self.backend = OrtBackend(artifact, self.group_num_blocks, threads, kernels=kernels)
        elif backend == "torch":
            from tqexport.runtime.backends.torch import TorchBackend

            self.backend = TorchBackend(artifact, self.group_num_blocks, source_model)
        elif backend == "trt":
            from tqexport.runtime.backends.trt import TrtBackend

            self.backend = TrtBackend(artifact, self.group_num_blocks)
        else:
            raise TQExportError(f"unknown backend {backend!r}; use ort, torch or trt")
        self.blocks = BlockManager(self.spec.groups, self.group_num_blocks)
        self.scheduler = Scheduler(
            self.blocks, max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold
        )
        self._next_id = 0
        self.group_block_bytes = [self.spec.group_block_bytes(g) for g in self.spec.groups]
        self.peak_kv_bytes = 0
        self.steps = 0

    @property
    def kernels(self) -> str:
        """What runs the layers' cache and attention ops, in words."""
        choice = getattr(self.backend, "kernel_choice", None)
        return choice.reason if choice is not None else f"{self.backend.name} backend"

    def add_request(self, prompt: list[int], params: SamplingParams) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise TQExportError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = list(prompt)
        if not prompt:
            raise TQExportError("empty prompt")
        for t in prompt:
            validate.integer(t, "prompt token ids")
        vocab = int(self.spec.model.get("vocab_size") or 0)
        if vocab and (min(prompt) < 0 or max(prompt) >= vocab):
            raise TQExportError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(self._next_id, prompt, params)
        self._next_id += 1
        limit = self.max_model_len
        if limit is not None and len(prompt) + params.max_tokens > limit:
            seq.finish(
                f"rejected: a prompt of {len(prompt)} tokens"
                + (f" plus max_tokens {params.max_tokens}" if len(prompt) < limit else "")
                + f" exceeds {limit_words(self.limit_name)} of {limit} tokens"
                + (f" ({self.limit_name})" if len(prompt) >= limit else "; lower max_tokens")
            )
            return seq
        self.scheduler.add(seq)
        return seq

    @property
    def kv_bytes_in_use(self) -> int:
        used = self.blocks.used_blocks()
        return sum(u * b for u, b in zip(used, self.group_block_bytes, strict=True))

    def step(self) -> list[StepEvent]:
        """Run one scheduled step; returns the tokens sampled in it. A sequence that fails while
        being stepped or sampled ends alone (finish_reason "error", the exception in ``error``);
        the others in the step go on as if it had not been there."""
        batch = self.scheduler.schedule()
        if not batch:
            if not self.scheduler.idle:
                raise RuntimeError("the scheduler could not schedule any waiting request")
            return []
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes_in_use)
        chunks = []
        for seq, n in batch:
            ends = seq.num_cached + n == seq.num_tokens
            chunks.append(
                SeqChunk(
                    seq.tokens[seq.num_cached : seq.num_cached + n],
                    seq.num_cached,
                    [list(t) for t in seq.block_tables],
                    "last" if ends else "none",
                )
            )
        events = []
        for (seq, n), row in zip(batch, self._run(chunks), strict=True):
            if isinstance(row, Exception):
                self.fail(seq, row)
                continue
            seq.num_cached += n
            if row is None:
                continue
            try:
                token = sample(row, seq.params, seq.rng)
            except Exception as e:
                self.fail(seq, e)
                continue
            seq.output.append(token)
            events.append(StepEvent(seq, token))
            p = seq.params
            if not p.ignore_stop and token in p.stop_token_ids:
                self.scheduler.finish(seq, "stop")
            elif len(seq.output) >= p.max_tokens:
                self.scheduler.finish(seq, "length")
        return events

    def _run(self, chunks: list[SeqChunk]) -> list[torch.Tensor | None | Exception]:
        """Per chunk: its logits row (None when it wants none), or the exception that running
        it raised. When the batched run raises, each chunk runs alone, so only the ones that
        fail alone fail (a chunk rewrites only its own cache slots: rerunning it is harmless)."""
        try:
            logits = self.backend.run(build_step(self.spec, chunks))
        except Exception as e:
            if len(chunks) == 1:
                return [e]
            return [self._run([c])[0] for c in chunks]
        self.steps += 1
        rows, i = [], 0
        for c in chunks:
            rows.append(None if c.want_logits == "none" else logits[i])
            i += c.want_logits != "none"
        return rows

    def fail(self, seq: Sequence, error: Exception) -> None:
        """End a running sequence that failed: finish_reason "error", its blocks freed."""
        seq.error = error
        self.scheduler.finish(seq, "error")

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        on_token: Callable[[StepEvent], None] | None = None,
    ) -> list[Sequence]:
        """Serve every prompt to completion as one continuous batch."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while not self.scheduler.idle:
            for event in self.step():
                if on_token:
                    on_token(event)
        return seqs

    def score(self, tokens: list[int]) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` at every position of one sequence (see
        :meth:`score_steps`)."""
        return torch.cat(list(self.score_steps(tokens)))

    def score_steps(self, tokens: list[int]) -> Iterator[torch.Tensor]:
        """Every position's logits of one sequence, one prefill step's rows at a time.

        The tokens are prefilled through the paged caches in steps of at most
        ``max_num_batched_tokens``, each asking the graph for every position's logits, so each
        token attends to cache entries stored in its layer's format. A caller scoring a long
        window holds one step's logits, not the window's. The blocks are freed after the last
        step (or when the iterator is closed).
        """
        if not self.scheduler.idle:
            raise RuntimeError("score() runs on an idle executor (requests are being served)")
        if not tokens or not self.blocks.fits_ever(len(tokens)):
            raise TQExportError(
                f"a text of {len(tokens)} tokens does not fit in the cache "
                f"({self.num_blocks - 1} blocks); raise --num-blocks or --kv-cache-memory"
            )
        seq = Sequence(self._next_id, list(tokens), SamplingParams(max_tokens=1))
        self._next_id += 1
        return self._prefill_steps(seq)

    def _prefill_steps(self, seq: Sequence) -> Iterator[torch.Tensor]:
        tokens = seq.prompt
        try:
            for start in range(0, len(tokens), self.scheduler.max_tokens):
                piece = tokens[start : start + self.scheduler.max_tokens]
                self.blocks.grow(seq, start + len(piece))
                tables = [list(t) for t in seq.block_tables]
                yield self.backend.run(
                    build_step(self.spec, [SeqChunk(piece, start, tables, "all")])
                )
                seq.num_cached = start + len(piece)
                self.steps += 1
        finally:
            if seq.block_tables:
                self.blocks.free(seq)
