"""Text side of serving: tokenizer, chat template, stop ids, UTF-8-safe streaming."""

from __future__ import annotations

import json
from pathlib import Path

from tqexport.errors import TQExportError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(artifact_dir: Path):
    if not any((artifact_dir / f).is_file() for f in TOKENIZER_FILES):
        raise TQExportError(
            f"{artifact_dir} has no tokenizer (built from a model without one, e.g. a tiny "
            "random built-in); serve it through the Python API with token ids"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(artifact_dir)


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    """Token ids of a user prompt, through the chat template when the model has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    return list(tokenizer(text)["input_ids"])


def stop_token_ids(artifact_dir: Path, tokenizer) -> tuple[int, ...]:
    """Every eos id of the generation config (Llama-3 has three) and the tokenizer's."""
    ids: set[int] = set()
    cfg = artifact_dir / "generation_config.json"
    if cfg.is_file():
        eos = json.loads(cfg.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


class StreamDecoder:
    """Emits only complete text: never splits a UTF-8 character across two pieces."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.emitted = ""

    def push(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
