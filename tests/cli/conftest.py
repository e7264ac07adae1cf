"""Fixtures of the CLI tests (tests/cli_helpers.py has their functions)."""

import pytest


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    """A small valid GGUF file (a 2-layer Llama's metadata, one tensor)."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("gguf") / "full.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()
