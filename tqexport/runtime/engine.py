"""The engine API (nano-vllm's ``LLMEngine`` in shape): requests in, per-step outputs out.

It wraps the :class:`~tqexport.runtime.executor.Executor` (scheduler, block manager, backend)
with what serving needs around it: the tokenizer and chat template, admission checks that fail
at ``add_request`` (never mid-run), ``abort``, stop strings and UTF-8-safe text deltas. A request
that fails while it runs (its step, sampling or text) ends alone with finish_reason "error".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqexport import validate
from tqexport.contract.artifact import Artifact, open_artifact
from tqexport.errors import TQExportError
from tqexport.runtime.blocks import BlockManager
from tqexport.runtime.chat import encode_messages
from tqexport.runtime.engine_config import EngineConfig
from tqexport.runtime.executor import Executor, limit_words
from tqexport.runtime.sequence import SamplingParams, Sequence, Status
from tqexport.runtime.text import (
    NORMALIZER_MERGE,
    StreamDecoder,
    encode_prompt,
    has_tokenizer,
    load_tokenizer,
    max_token_chars,
    stop_token_ids,
    tokenizer_file,
)

__all__ = ["Completion", "Engine", "EngineConfig", "EngineStats", "RequestOutput"]

#: a prompt: text, token ids, or chat messages (``[{"role": ..., "content": ...}, ...]``)
Prompt = str | list[int] | list[dict]
#: stop strings one request may give
MAX_STOP_STRINGS = 16


@dataclass
class RequestOutput:
    """What one step did for one request: its new tokens and text, and whether it ended.

    ``finish_reason``: "stop" (a stop token or string), "length" (max_tokens), "abort" or
    "error" (this request alone failed; ``error`` says why)."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: BaseException | None = None


@dataclass
class Completion:
    """A finished request, as ``generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    #: why it failed (finish_reason "error")
    error: BaseException | None = None


@dataclass
class EngineStats:
    """A snapshot for metrics: requests, blocks per cache group, cumulative counters."""

    running: int
    waiting: int
    blocks_used: list[int]
    blocks_free: list[int]
    preemptions: int
    prompt_tokens: int
    generation_tokens: int


@dataclass
class _Request:
    id: str
    seq: Sequence
    stop: tuple[str, ...]
    decoder: StreamDecoder | None
    text: str = ""  # decoded so far, cut at a stop string
    sent: int = 0  # characters of ``text`` already in outputs
    reported: int = 0  # output tokens already in outputs


def position_limit(artifact: Artifact, tokenizer=None) -> int | None:
    """The model's position limit (``max_position_embeddings``): as the build recorded it in
    the spec, else (an artifact built before it was) as :func:`_source_position_limit` finds."""
    recorded = artifact.spec.max_position_embeddings
    return recorded if recorded is not None else _source_position_limit(artifact, tokenizer)[0]


def limit_fallback_note(artifact: Artifact, max_model_len: int | None, tokenizer=None):
    """One line for an artifact built before its spec recorded the model's position limit,
    served without ``--max-model-len``: what the memory plan is sized by instead (None: no
    need to say)."""
    if max_model_len is not None or artifact.spec.max_position_embeddings is not None:
        return None
    limit, where = _source_position_limit(artifact, tokenizer)
    sized = "the whole budget (no limit known)" if limit is None else f"{limit} tokens ({where})"
    return (
        f"{artifact.path} was built before tqexport recorded the model's position limit: the "
        f"memory plan is sized for {sized}; give --max-model-len or rebuild it"
    )


def _source_position_limit(artifact: Artifact, tokenizer=None) -> tuple[int | None, str]:
    """(limit, where it came from) for a spec without one: the source model's config (built-ins
    and HF directories; reading a GGUF's metadata takes seconds, so not those), else the
    tokenizer's ``model_max_length`` when it is set."""
    model = artifact.spec.model

    def positive(v):
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    path, source = model.get("path"), str(model.get("source", ""))
    if isinstance(path, str) and path and not source.startswith("gguf:"):
        try:
            from tqexport.models.config import load_config

            config, _ = load_config(path)
            cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
            if positive(getattr(cfg, "max_position_embeddings", None)):
                return cfg.max_position_embeddings, "the source model's config"
        except Exception:  # the source moved or changed: fall back to the tokenizer
            pass
    n = positive(getattr(tokenizer, "model_max_length", None))
    if n is not None and n < 10**7:  # transformers' "unset" is ~1e30
        return n, "the tokenizer's model_max_length"
    return None, ""


def context_limit(artifact: Artifact, max_model_len: int | None = None, tokenizer=None):
    """(the longest sequence served, what sets it): ``max_model_len`` (``--max-model-len``, at
    most the model's position limit), else the model's position limit (None: unknown)."""
    limit = position_limit(artifact, tokenizer)
    if max_model_len is None:
        return limit, "max_position_embeddings"
    if limit is not None and max_model_len > limit:
        raise TQExportError(
            f"--max-model-len {max_model_len} exceeds the model's position limit of {limit} "
            "tokens; lower it"
        )
    return max_model_len, "--max-model-len"


def cache_token_limit(blocks: BlockManager) -> int | None:
    """The longest sequence the whole cache holds (None: any length, every group is windowed)."""
    hi = 2**40
    if blocks.fits_ever(hi):
        return None
    lo = 0  # fits_ever(lo) holds, fits_ever(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if blocks.fits_ever(mid) else (lo, mid)
    return lo


def _finish_reason(reason: str | None) -> str:
    return "length" if (reason or "").startswith("length") else (reason or "abort")


def _check_stop(stop) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise TQExportError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if not all(isinstance(s, str) and s for s in stop):
        raise TQExportError("stop strings must be non-empty text")
    return stop


class Engine:
    """One artifact served: ``add_request`` / ``step`` / ``abort``, or ``generate``."""

    def __init__(self, artifact: Artifact, config: EngineConfig | None = None, source_model=None):
        """``source_model``: the torch backend's already loaded model (skips reloading it)."""
        self.artifact = artifact
        self.config = config = config or EngineConfig()
        path = artifact.path
        self.tokenizer = load_tokenizer(path) if has_tokenizer(path) else None
        #: the longest sequence served (None: unknown), and what sets it
        self.max_model_len, self.limit_name = context_limit(
            artifact, config.max_model_len, self.tokenizer
        )
        #: one line to show where the artifact predates the recorded position limit (or None)
        self.limit_note = limit_fallback_note(artifact, config.max_model_len, self.tokenizer)
        # the cache size is checked against this machine's memory before the weights load
        config.group_blocks(artifact, validate.physical_memory(), self.max_model_len)
        self.eos_token_ids = stop_token_ids(path, self.tokenizer)
        #: (characters one token stands for at most, the vocabulary's longest entry)
        self.token_chars = max_token_chars(self.tokenizer) if self.tokenizer else None
        self.executor = Executor(
            artifact,
            backend=config.backend,
            num_blocks=config.num_blocks,
            kv_cache_memory=config.memory,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            threads=config.threads,
            source_model=source_model,
            max_model_len=self.max_model_len,
            limit_name=self.limit_name,
            kernels=config.kernels,
        )
        #: the longest sequence the whole cache holds (None: any)
        self.max_cache_tokens = cache_token_limit(self.executor.blocks)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()

    @classmethod
    def from_artifact(cls, path: str | Path, config: EngineConfig | None = None) -> Engine:
        return cls(open_artifact(path), config)

    @property
    def max_seq_len(self) -> int | None:
        """Prompt + max_tokens a request may have (the context or the cache, the smaller)."""
        limits = [n for n in (self.max_model_len, self.max_cache_tokens) if n is not None]
        return min(limits) if limits else None

    def _limit_text(self) -> str:
        limit = self.max_seq_len
        if limit == self.max_model_len:
            return f"{limit_words(self.limit_name)} of {limit} tokens"
        return f"the {limit} tokens the whole KV cache holds"

    def check_prompt_size(self, prompt: Prompt) -> None:
        """Refuse, before any tokenizing, a prompt too long to fit: more token ids than the
        context, or more characters than that many tokens can stand for."""
        limit = self.max_seq_len
        if limit is None or not isinstance(prompt, (str, list, tuple)):
            return
        if isinstance(prompt, str) or any(isinstance(m, dict) for m in prompt):
            parts = [prompt] if isinstance(prompt, str) else prompt
            texts = [m.get("content") if isinstance(m, dict) else m for m in parts]
            chars = sum(len(t) for t in texts if isinstance(t, str))
            if self.token_chars is None or chars <= limit * self.token_chars[0]:
                return
            bound, longest = self.token_chars
            raise TQExportError(
                f"a prompt of {chars} characters cannot fit {self._limit_text()}: one token "
                f"stands for at most {bound} characters (the vocabulary's longest entry, "
                f"{longest}, times {NORMALIZER_MERGE} for normalization), so it needs more than "
                f"{limit} tokens; shorten it"
            )
        n = len(prompt)
        if n > limit and limit == self.max_model_len:
            raise TQExportError(
                f"a prompt of {n} tokens exceeds {limit_words(self.limit_name)} of {limit} tokens "
                f"({self.limit_name})"
            )
        if n > limit:
            bs = self.executor.blocks.groups[0].block_size
            raise TQExportError(
                f"a prompt of {n} tokens does not fit in the whole KV cache ({limit} tokens in "
                f"blocks of {bs}); shorten it or raise --num-blocks / --kv-cache-memory"
            )

    def prompt_ids(self, prompt: Prompt, chat_template: bool | None = None) -> list[int]:
        """Token ids of a prompt (:meth:`encode`), a prompt too long to fit refused first
        (:meth:`check_prompt_size`). It reads no request state: any thread may call it."""
        self.check_prompt_size(prompt)
        return self.encode(prompt, chat_template)

    def max_new_tokens(self, num_prompt_tokens: int) -> int | None:
        """The most tokens a prompt of this length may generate (None: no limit)."""
        limit = self.max_seq_len
        return None if limit is None else max(0, limit - num_prompt_tokens)

    def require_tokenizer(self):
        """The tokenizer; an artifact without one raises TQExportError saying so."""
        if self.tokenizer is None:
            load_tokenizer(self.artifact.path)  # raises its "has no tokenizer" message
        return self.tokenizer

    def _checked(self, ids: list[int], label: str) -> list[int]:
        """Ids the tokenizer gave, refused when outside the model's vocabulary."""
        vocab = int(self.artifact.spec.model.get("vocab_size") or 0)
        bad = [t for t in ids if not 0 <= t < vocab] if vocab else []
        if bad:
            raise TQExportError(
                f"{tokenizer_file(self.artifact.path)} gives token id {bad[0]} for {label}, "
                f"outside the model's vocabulary of {vocab}: the tokenizer does not belong to "
                "this model"
            )
        return ids

    def encode(
        self, prompt: Prompt, chat_template: bool | None = None, label: str = "the prompt"
    ) -> list[int]:
        """Token ids of a prompt: ids as given; text raw or through the chat template
        (``chat_template`` None: the config's setting); messages through the chat template.
        ``label`` names the prompt in errors."""
        if isinstance(prompt, str):
            if not prompt:
                raise TQExportError("empty prompt")
            use = self.config.chat_template if chat_template is None else chat_template
            tok = self.require_tokenizer()
            return self._checked(encode_prompt(tok, prompt, use, self.artifact.path), label)
        if not isinstance(prompt, (list, tuple)):
            raise TQExportError(
                "a prompt is text, a list of token ids or a list of chat messages, "
                f"not {type(prompt).__name__}"
            )
        if any(isinstance(m, dict) for m in prompt):
            if not self.config.chat_template:
                raise TQExportError("chat messages need the chat template, which is turned off")
            tok = self.require_tokenizer()
            return self._checked(encode_messages(tok, list(prompt), self.artifact.path), label)
        return list(prompt)

    def _admit(self, n: int, max_tokens: int) -> None:
        """Refuse a prompt whose max_tokens can never fit in the whole cache (the executor
        refuses the rest: a prompt alone too long for the cache or the model's positions)."""
        cache = self.max_cache_tokens
        if cache is not None and 0 < n < cache < n + max_tokens:
            bs = self.executor.blocks.groups[0].block_size
            raise TQExportError(
                f"a prompt of {n} tokens plus max_tokens {max_tokens} does not fit in the whole "
                f"KV cache ({cache} tokens in blocks of {bs}); lower max_tokens or raise "
                "--num-blocks / --kv-cache-memory"
            )

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        stop: str | Iterable[str] = (),
        ignore_eos: bool = False,
        chat_template: bool | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Every reason it could never run (an empty prompt,
        token ids outside the vocabulary, more than the context or the cache holds) raises
        TQExportError here. The model's eos ids stop it unless ``ignore_eos``."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TQExportError(f"params must be SamplingParams, got {type(params).__name__}")
        stop = _check_stop(stop)
        if stop and self.tokenizer is None:
            raise TQExportError("stop strings need a tokenizer, and this artifact has none")
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise TQExportError(f"request id {rid!r} is already in use")
        ids = self.prompt_ids(prompt, chat_template)
        self._admit(len(ids), params.max_tokens)
        if not ignore_eos:
            stops = tuple(sorted(set(params.stop_token_ids) | set(self.eos_token_ids)))
            params = replace(params, stop_token_ids=stops)
        seq = self.executor.add_request(ids, params)
        if seq.status is Status.FINISHED:  # refused: the model's positions or the whole cache
            raise TQExportError((seq.finish_reason or "rejected").removeprefix("rejected: "))
        decoder = StreamDecoder(self.tokenizer) if self.tokenizer is not None else None
        self._requests[rid] = _Request(rid, seq, stop, decoder)
        self.prompt_tokens += len(ids)
        return rid

    def abort(self, request_id: str) -> bool:
        """Drop a request now, its blocks back to the free lists; False if it is unknown."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.executor.scheduler.abort(req.seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; one output per request that got a token or finished. A
        request that fails ends alone: finish_reason "error", the exception in ``error``."""
        self.executor.step()
        outputs = []
        for rid, req in list(self._requests.items()):
            seq = req.seq
            tokens = seq.output[req.reported :]
            finished = seq.status is Status.FINISHED
            if not tokens and not finished:
                continue
            req.reported = len(seq.output)
            self.generation_tokens += len(tokens)
            try:
                delta, stopped = ("", False) if seq.error else self._text(req, finished)
            except Exception as e:  # detokenizing or stop strings of this request alone
                self.executor.scheduler.abort(seq, "error")
                seq.finish("error")
                seq.error, delta, stopped, finished = e, "", False, True
            if stopped:
                if finished:
                    seq.finish("stop")
                else:
                    self.executor.scheduler.abort(seq, "stop")
                    finished = True
            if finished:
                del self._requests[rid]
            outputs.append(
                RequestOutput(
                    rid,
                    tokens,
                    delta,
                    finished,
                    _finish_reason(seq.finish_reason) if finished else None,
                    len(seq.prompt),
                    len(seq.output),
                    seq.error,
                )
            )
        return outputs

    def _text(self, req: _Request, finished: bool) -> tuple[str, bool]:
        """The request's next text delta, and whether a stop string ended it. Text that may be
        the start of a stop string is held back until it is known not to be one."""
        if req.decoder is None:
            return "", False
        piece = req.decoder.push(req.seq.output)
        if finished:  # flush an incomplete character the decoder held back
            full = self.tokenizer.decode(req.seq.output, skip_special_tokens=True)
            done = req.decoder.emitted
            piece += full[len(done) :] if full.startswith(done) else ""
        longest = max((len(s) for s in req.stop), default=0)
        start = max(0, len(req.text) - longest + 1)
        req.text += piece
        hits = [i for s in req.stop if (i := req.text.find(s, start)) >= 0]
        if hits:
            req.text = req.text[: min(hits)]
        hold = 0 if finished or hits else max(0, longest - 1)
        end = max(req.sent, len(req.text) - hold)
        delta, req.sent = req.text[req.sent : end], end
        return delta, bool(hits)

    def drain(
        self, on_output: Callable[[RequestOutput], None] | None = None
    ) -> dict[str, Completion]:
        """Step until every queued request has finished; their completions by request id."""
        done = {rid: Completion(rid, list(r.seq.prompt)) for rid, r in self._requests.items()}
        while self.has_unfinished():
            for out in self.step():
                c = done[out.request_id]
                c.token_ids += out.new_token_ids
                c.text += out.text
                c.finish_reason, c.error = out.finish_reason, out.error
                if on_output is not None:
                    on_output(out)
        return done

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        stop: str | Iterable[str] = (),
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[Completion]:
        """Serve every prompt to completion as one continuous batch (on an idle engine); any
        prompt that cannot run raises before anything runs. One that fails while running ends
        alone (finish_reason "error", ``error`` says why); the others complete."""
        if self.has_unfinished():
            raise TQExportError("generate() needs an idle engine: step or abort its requests")
        if not isinstance(prompts, list):
            raise TQExportError(f"generate() takes a list of prompts, not {type(prompts).__name__}")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise TQExportError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        rids: list[str] = []
        try:
            for p, sp in zip(prompts, plist, strict=True):
                rids.append(self.add_request(p, sp, stop=stop))
        except BaseException:
            for rid in rids:
                self.abort(rid)
            raise
        done = self.drain(on_output)
        return [done[rid] for rid in rids]

    def stats(self) -> EngineStats:
        sched, blocks = self.executor.scheduler, self.executor.blocks
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            blocks_used=blocks.used_blocks(),
            blocks_free=[len(g.free) for g in blocks.groups],
            preemptions=sched.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )
