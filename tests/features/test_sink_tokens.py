"""Sink tokens (--kv-sink-tokens S, with --kv-recent-window N): the first S tokens of every
sequence also kept in the layer's model-dtype recent cache, whose group never frees their
blocks, and read from there. S = 0 is exactly the recent-window design."""

import json

import pytest
import torch
from helpers import assert_greedy, assert_same_run, prefill_chunks, serve_on_torch

from tqexport.errors import TQExportError
from tqexport.kvplan.resolve import ResolveError, resolve
from tqexport.models.config import describe_model
from tqexport.models.loader import load_model
from tqexport.runtime.blocks import NULL_BLOCK, GroupAllocator
from tqexport.spec import (
    BuildRequest,
    CacheGroup,
    SpecError,
    spec_from_dict,
    spec_from_json,
)

TOKENS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama", "float32")


def test_spec_records_sinks_per_layer_and_group_and_refuses_what_does_not_fit():
    desc = describe_model("tiny-gemma2", None)  # sliding(8) / full alternating
    plain = resolve(desc, BuildRequest("fp8", ["0"], recent_window=32)).spec
    assert resolve(desc, BuildRequest("fp8", ["0"], recent_window=32, sink_tokens=0)).spec == plain
    assert "sink" not in plain.to_json()
    spec = resolve(desc, BuildRequest("fp8", ["0"], recent_window=32, sink_tokens=4)).spec
    assert [la.sink_tokens for la in spec.layers] == [0, 4, 4, 4, 4, 4]
    assert [(g.window, g.sink_tokens) for g in spec.groups if g.recent] == [(8, 4), (32, 4)]
    assert spec.request.sink_tokens == 4 and spec.sink_tokens == 4
    assert spec.graph_io() == plain.graph_io()  # the sinks live in the recent caches
    assert spec_from_json(spec.to_json()) == spec
    d = json.loads(spec.to_json())
    assert d["layers"][1]["recent"]["sink_tokens"] == 4 and d["groups"][-1]["sink_tokens"] == 4
    bad = json.loads(spec.to_json())
    bad["layers"][1]["recent"]["sink_tokens"] = 2
    with pytest.raises(SpecError, match="recent-window group with its window and sink tokens"):
        spec_from_dict(bad)
    bad = json.loads(spec.to_json())
    bad["groups"][0]["sink_tokens"] = 4
    with pytest.raises(SpecError, match="'sink_tokens' belongs to a recent-window group only"):
        spec_from_dict(bad)
    bad = json.loads(plain.to_json())
    bad["request"]["sink_tokens"] = 4
    with pytest.raises(SpecError, match="1: 0 sink tokens but the request"):
        spec_from_dict(bad)
    bad["request"].pop("recent_window")
    with pytest.raises(SpecError, match="'sink_tokens' needs a recent_window"):
        spec_from_dict(bad)
    with pytest.raises(ResolveError, match="--kv-sink-tokens 4 needs --kv-recent-window >= 1"):
        resolve(desc, BuildRequest("fp8", sink_tokens=4))
    with pytest.raises(TQExportError, match="--kv-sink-tokens must be from 0 to 1024, got -1"):
        BuildRequest("fp8", recent_window=8, sink_tokens=-1)


def test_recent_group_keeps_the_sink_blocks_and_sizes_for_them():
    group = CacheGroup(1, 8, 4, (0,), recent=True, sink_tokens=5)  # sinks in blocks 0 and 1
    assert group.sink_blocks == 2
    assert group.live_blocks(100) == 2 + 2 + 2 and group.live_blocks(6) == 2
    assert group.max_blocks(max_num_seqs=3, max_step_tokens=8) == 1 + 3 * 6 + 2
    alloc = GroupAllocator(group, 40)
    table: list[int] = []
    alloc.grow(table, 40)
    kept = table[:2]
    alloc.drop_out_of_window(table, 40)  # queries from 40 on see 33.. and the sinks
    assert table[:2] == kept and NULL_BLOCK not in kept
    assert table[2:8] == [NULL_BLOCK] * 6 and NULL_BLOCK not in table[8:]
    plain = GroupAllocator(CacheGroup(1, 8, 4, (0,), recent=True), 40)
    table = []
    plain.grow(table, 40)
    plain.drop_out_of_window(table, 40)
    assert table[:8] == [NULL_BLOCK] * 8


def test_sinks_and_window_covering_the_context_read_only_full_precision(llama):
    """32 sink tokens and an 8-token window cover all 40 positions: no key is read from the
    quantized cache, so the logits are the unquantized ones (three segments, summed in another
    order: within 1e-5), for any chunking."""
    desc = llama.description
    spec = resolve(
        desc, BuildRequest("turboquant_3bit_nc", boundary=False, recent_window=8, sink_tokens=32)
    ).spec
    whole = prefill_chunks(llama, spec, TOKENS, 40)
    auto = prefill_chunks(llama, resolve(desc, BuildRequest("auto")).spec, TOKENS, 40).logits
    torch.testing.assert_close(whole.logits, auto, atol=1e-5, rtol=1e-5)
    for chunk in (9, 1):
        assert_same_run(spec, prefill_chunks(llama, spec, TOKENS, chunk), whole)
    fewer = resolve(
        desc, BuildRequest("turboquant_3bit_nc", boundary=False, recent_window=8, sink_tokens=4)
    ).spec
    got = prefill_chunks(llama, fewer, TOKENS, 40).logits
    torch.testing.assert_close(got[:12], auto[:12], atol=1e-5, rtol=1e-5)  # 4 + 8 cover them
    assert (got[12:] - auto[12:]).abs().max() > 1e-3  # later positions read quantized keys


def test_executor_keeps_sink_blocks_through_recycling(llama):
    """Served through the block manager (window blocks recycled, sink blocks kept), a long
    generation equals a prefill of the same tokens with contiguous tables."""
    spec = resolve(
        llama.description,
        BuildRequest("turboquant_4bit_nc", boundary=False, recent_window=8, sink_tokens=5),
    ).spec
    ex, seq = serve_on_torch(llama, spec, TOKENS[:20])
    recent_group = next(g.id for g in spec.groups if g.recent)
    assert ex.group_num_blocks[recent_group] == 1 + 2 * (1 + 2 + 1) + 1 < 16
    tokens = seq.prompt + seq.output
    logits = prefill_chunks(llama, spec, tokens[:-1], 59, num_blocks=8).logits
    assert assert_greedy(logits[19:], seq.output) > 30


def test_the_op_refuses_sink_tokens_without_a_recent_window():
    from tqexport.kvquant.codecs import make_codec
    from tqexport.ops import reference

    codec = make_codec("fp8", 64, model_dtype="float32")
    with pytest.raises(ValueError, match="sink tokens are read from the recent cache"):
        reference.paged_attention(codec, None, None, None, None, None, None, scale=1.0,
                                  sink_tokens=4)  # fmt: skip
