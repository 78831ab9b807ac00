"""dflash's own experts forward for extraction: transformers' grouped GEMMs, without what training and expert
parallelism need of them, registered with transformers as the experts implementation `NAME`.

transformers' `grouped_mm` experts serve training and expert parallelism too, so beside the two grouped GEMMs a layer
passes its rows through work a forward under no_grad on one rank does not need: in 5.17 three masks a layer of every
routed row (expert-parallel sentinels, two of them out of place; 5.25 skips them off expert parallelism), a product by
the routing weights, an inverse permutation built and gathered, then a sum over the top-k. Here the rows are sorted
by expert once, run through the same grouped GEMMs (transformers' `_grouped_mm`, so the same kernel on every device),
written back to token order by one scatter, and the routing weights and the sum over the top-k are one batched
matmul in the rows' dtype (its products accumulate in float32; a float32 router's weights, DeepSeek-V3's, are rounded
to bf16 once, 2**-9 relative, the rounding the sum's result gets there anyway); inside a compiled layer
(--compile-layers) the scatter and the matmul are k gathered rows weighted and summed in float32, one pointwise pass.
Under autograd, with experts split over ranks (transformers 5.25's flag; dflash never splits them: FSDP2 gathers every
expert's weights), or with a norm after each expert, transformers' own forward runs instead.

On CUDA it is the first experts implementation extract tries (targets/kernels.experts_order), kept, as every
candidate, only where the start-up self-check finds it equal to the eager float32 forward: on one H100 with
transformers 5.17 a Qwen3-30B-A3B-shaped forward ran 1.28x transformers' grouped_mm with it (30,659 against 23,997
tok/s, bench/RESULTS.md, issue 44). On the CPU, where it timed equal, transformers' own forward runs.
"""
from __future__ import annotations

from typing import Any

__all__ = ["NAME", "register", "forward"]

NAME = "dflash_grouped_mm"


def register() -> bool:
    """Register `forward` with transformers' experts interface as NAME, once; False where this transformers has no
    grouped experts."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    except ImportError:
        return False
    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(NAME, forward)
    return True


def forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """The experts of one layer for every token: [T, H] hidden states, [T, k] expert indices and routing weights ->
    [T, H], the routing-weighted sum of each token's k experts."""
    import torch
    from transformers.integrations.moe import _grouped_mm as mm, grouped_mm_experts_forward as theirs

    if (torch.is_grad_enabled() or getattr(self, "_is_expert_parallel", False)
            or getattr(self, "has_post_expert_norm", False)):
        return theirs(self, hidden_states, top_k_index, top_k_weights)
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    sorted_experts, order = torch.sort(experts)
    rows = hidden_states.index_select(0, order // k)
    # histc rather than bincount: no host sync (bincount sizes its output from the data); CUDA takes integers, the
    # CPU floats
    counts = torch.histc(sorted_experts.int() if hidden_states.is_cuda else sorted_experts.float(),
                         bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    if self.has_gate:
        weight, bias = self.gate_up_proj, (self.gate_up_proj_bias if self.has_bias else None)
    else:
        weight, bias = self.up_proj, (self.up_proj_bias if self.has_bias else None)
    up = mm(rows.to(weight.dtype), weight if self.is_transposed else weight.transpose(-2, -1), offs=offsets)
    if bias is not None:
        up.add_(bias.index_select(0, sorted_experts))
    act = self._apply_gate(up) if self.has_gate else self.act_fn(up)
    del up
    down_w = self.down_proj
    out = mm(act.to(down_w.dtype), down_w if self.is_transposed else down_w.transpose(-2, -1), offs=offsets)
    del act
    if self.has_bias:
        out.add_(self.down_proj_bias.index_select(0, sorted_experts))
    weights = top_k_weights.to(out.dtype)
    if torch.compiler.is_compiling():
        return _summed_compiled(out, order, weights, tokens, k, hidden).to(hidden_states.dtype)
    by_token = torch.empty_like(out)
    by_token.index_copy_(0, order, out)  # back to token order: row t * k + j is token t's j-th expert
    del out
    summed = torch.bmm(weights.reshape(tokens, 1, k), by_token.view(tokens, k, hidden))
    return summed.view(tokens, hidden).to(hidden_states.dtype)


def _summed_compiled(out: Any, order: Any, weights: Any, tokens: int, k: int, hidden: int) -> Any:
    """Return the routing-weighted sum [T, H] of each token's k expert rows, `out` in expert order, as a compiled
    layer runs it: k products and adds of rows gathered by the inverse permutation, in float32, which inductor makes
    one pointwise kernel whose loads run along the hidden size. Written as a sum over k, inductor made it a
    reduction that laid its threads across the k rows: 585 us a layer, 4.4x its bytes' time at the memory's speed;
    unrolled, 215 us, and a compiled Qwen3-30B-A3B-shaped forward ran 1.12x (54,562 -> 60,864 tok/s, MFU 33.3% ->
    37.2%, one H100, bench/RESULTS.md, 2026-12-06). `dflash extract` with it did not move (50,570 against 51,111
    tok/s) while its layers were first called on the self-check's 2 rows of 96 tokens; first called on a batch of
    the run's size (kernels.warm_forward) it ran 53,999 tok/s (33.0% MFU). The eager path's scatter to token order and
    batched matmul are two passes (the matmul's tiles suit a sum over 8 rows badly)."""
    import torch

    inverse = torch.empty_like(order)
    inverse.index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    inverse = inverse.view(tokens, k)
    w = weights.float().view(tokens, k)
    summed = out.index_select(0, inverse[:, 0]).float() * w[:, :1]
    for j in range(1, k):
        summed = summed + out.index_select(0, inverse[:, j]).float() * w[:, j : j + 1]
    return summed
