"""A transformers causal LM driven through paged caches: one step of the graph contract
(:mod:`tqexport.contract.steps`).

``PagedCausalLM.forward(*inputs)`` takes the graph inputs in ``spec.graph_io()`` order and
returns ``(logits, *caches)`` in output order. It is what gets exported to ONNX, and what the
torch backend runs eagerly.
"""

from __future__ import annotations

import torch

from tqexport.models.hook import ATTENTION_NAME, StepContext, StepInputs
from tqexport.spec import ModelSpec

FIXED_INPUTS = ("input_ids", "positions", "seq_lens", "query_start_loc", "logits_indices")


class PagedCausalLM(torch.nn.Module):
    def __init__(
        self,
        hf_model: torch.nn.Module,
        spec: ModelSpec,
        mode: str = "functional",
        observer=None,
        key_observer=None,
    ):
        super().__init__()
        self.model = hf_model
        self.spec = spec
        self.mode = mode
        self.observer = observer
        self.key_observer = key_observer
        self.num_heads = int(spec.model["num_heads"])
        hf_model.config._attn_implementation = ATTENTION_NAME
        for sub in hf_model.modules():
            if hasattr(sub, "config") and hasattr(sub.config, "_attn_implementation"):
                sub.config._attn_implementation = ATTENTION_NAME
        self.cache_layout = [
            (la.index, len(la.cache_tensors)) for la in spec.layers
        ]  # per layer: how many cache tensors, in graph order

    def split_inputs(self, inputs):
        n_groups = len(self.spec.groups)
        fixed = dict(zip(FIXED_INPUTS, inputs[:5], strict=True))
        per_group = inputs[5 : 5 + 2 * n_groups]
        flat = list(inputs[5 + 2 * n_groups :])
        caches = {}
        for index, count in self.cache_layout:
            caches[index], flat = list(flat[:count]), flat[count:]
        step = StepInputs(
            positions=fixed["positions"],
            seq_lens=fixed["seq_lens"],
            query_start_loc=fixed["query_start_loc"],
            slot_mappings=list(per_group[0::2]),
            block_tables=list(per_group[1::2]),
        )
        return fixed, step, caches

    def forward(self, *inputs):
        fixed, step, caches = self.split_inputs(inputs)
        ctx = StepContext(
            self.spec,
            self.num_heads,
            step,
            caches,
            mode=self.mode,
            observer=self.observer,
            key_observer=self.key_observer,
        )
        out = self.model(
            input_ids=fixed["input_ids"].unsqueeze(0),
            position_ids=fixed["positions"].unsqueeze(0),
            logits_to_keep=fixed["logits_indices"],
            use_cache=False,
            tq_step=ctx,
        )
        if self.mode != "export":
            ctx.check_all_hit()
        logits = out.logits[0].float()
        new = caches if self.mode == "inplace" else ctx.new_caches
        return (logits, *[t for index, _ in self.cache_layout for t in new[index]])
