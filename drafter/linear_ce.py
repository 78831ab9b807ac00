"""A weighted cross-entropy through a frozen lm_head that never holds more than one chunk of logits."""
from __future__ import annotations

import logging

import torch

__all__ = ["chunked_linear_ce", "chunked_linear_ce_topk", "chunked_linear_ce_rows", "candidate_logits",
           "default_chunk_rows"]

log = logging.getLogger(__name__)

# About 2.3 GiB of fp32 logits per chunk (4,096 rows of Qwen3's 151,936-token vocabulary): small next to an H200,
# and fewer, larger matmuls. With the layers compiled, 4,096 rows took the 8B-sized drafter's step from MFU 44.0% to
# 46.2% against ~1 GiB chunks (bench/RESULTS.md); without, that batch ran out of the H200's memory.
_CHUNK_BYTES = 4096 * 4 * 151_936


def default_chunk_rows(vocab_size: int) -> int:
    """Return the rows per chunk that keep one chunk of fp32 logits near 2.3 GiB (a multiple of 128, >= 128)."""
    return max(128, (_CHUNK_BYTES // (4 * vocab_size)) // 128 * 128)


def _chunked_ce(hidden, weight, labels, scale, chunk_rows, need_grad, multiplier, softcap, top_k):
    """Return (CE_i, argmax_i, top_k ids_i, their log-probabilities, d sum_i scale_i CE_i / d hidden or None), one
    chunk of logits alive at a time; the logits are f(hidden @ weight.T) with f the target's multiplier and softcap.

    scale None: the gradient of each row's own CE (unscaled), for a caller whose weights depend on the CE (D-PACE).
    """
    n = hidden.shape[0]
    w = weight.to(hidden.dtype)
    grad = torch.empty_like(hidden) if need_grad else None
    acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax in fp32 at least (fp64 stays exact)
    ce = torch.empty(n, dtype=acc, device=hidden.device)
    pred = torch.empty(n, dtype=torch.long, device=hidden.device)
    cand = torch.empty(n, top_k, dtype=torch.long, device=hidden.device)
    cand_lp = torch.empty(n, top_k, dtype=acc, device=hidden.device)
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        logits = (hidden[s:e] @ w.T).to(acc)
        if multiplier != 1.0:
            logits.mul_(multiplier)
        if softcap is not None:
            capped = torch.tanh(logits / softcap)
            logits = capped * softcap
        lab = labels[s:e, None]
        lse = torch.logsumexp(logits, dim=-1)
        ce[s:e] = lse - logits.gather(1, lab)[:, 0]
        pred[s:e] = logits.argmax(dim=-1)
        if top_k:
            top = torch.topk(logits, top_k, dim=-1)  # sorted: the weakest candidate last
            cand[s:e] = top.indices
            cand_lp[s:e] = top.values - lse[:, None]
        if need_grad:
            # softmax - onehot, scaled by each row's loss weight, in place to keep one chunk of logits alive.
            probs = logits.sub_(lse[:, None]).exp_()
            probs.scatter_add_(1, lab, torch.full_like(lab, -1, dtype=probs.dtype))
            if scale is not None:
                probs.mul_(scale[s:e, None].to(acc))
            if softcap is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2
                probs.mul_(1.0 - capped * capped)
                del capped
            if multiplier != 1.0:
                probs.mul_(multiplier)
            grad[s:e] = probs.to(hidden.dtype) @ w
        del logits
    return ce, pred, cand, cand_lp, grad


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_i scale_i * CE(f(hidden_i @ weight.T), label_i); the input gradient is formed chunk by chunk in forward.

    Because weight is frozen and the loss is the only consumer of the logits, the gradient of each chunk is known
    as soon as its softmax is: computing it there costs one more matmul and no recomputation in backward.
    The saved gradient is the size of hidden, the chunk of logits is freed at once.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, chunk_rows, multiplier, softcap, top_k):  # type: ignore[override]
        need_grad = ctx.needs_input_grad[0]
        ce, pred, cand, cand_lp, grad = _chunked_ce(hidden, weight, labels, scale, chunk_rows, need_grad, multiplier,
                                                    softcap, top_k)
        loss = (ce * scale.to(ce.dtype)).sum()
        ctx.mark_non_differentiable(ce, pred, cand, cand_lp)
        if need_grad:
            ctx.save_for_backward(grad)
        return loss, ce, pred, cand, cand_lp

    @staticmethod
    def backward(ctx, g_loss, g_ce, g_pred, g_cand, g_cand_lp):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * g_loss.to(grad.dtype), None, None, None, None, None, None, None


class _ChunkedLinearCERows(torch.autograd.Function):
    """CE(f(hidden_i @ weight.T), label_i) per row, differentiable: each row's gradient is formed in forward,
    unscaled, and scaled in backward by the weight the caller put on that row (known only once the CE is)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows, multiplier, softcap, top_k):  # type: ignore[override]
        need_grad = ctx.needs_input_grad[0]
        ce, pred, cand, cand_lp, grad = _chunked_ce(hidden, weight, labels, None, chunk_rows, need_grad, multiplier,
                                                    softcap, top_k)
        ctx.mark_non_differentiable(pred, cand, cand_lp)
        if need_grad:
            ctx.save_for_backward(grad)
        return ce, pred, cand, cand_lp

    @staticmethod
    def backward(ctx, g_ce, g_pred, g_cand, g_cand_lp):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        # The product in fp32: the rows' weights span orders of magnitude, bf16 would round them twice.
        return (grad.float() * g_ce.float()[:, None]).to(grad.dtype), None, None, None, None, None, None


def chunked_linear_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    chunk_rows: int | None = None,
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (sum_i scale_i * CE_i, CE_i [N] (fp32 or wider) detached, argmax_i [N]) for logits hidden [N, H] @ weight.T.

    weight [V, H] is frozen (no gradient); scale [N] holds each row's loss weight already divided by the batch's
    weight total. Peak extra memory is one chunk of fp32 logits, never [N x V]. multiplier and softcap transform
    the logits as the target's config says (unary_logits in model.py); the defaults leave them as they are.
    """
    loss, ce, pred, _, _ = chunked_linear_ce_topk(hidden, weight, labels, scale, 0, chunk_rows, multiplier=multiplier,
                                               softcap=softcap)
    return loss, ce, pred


def chunked_linear_ce_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    top_k: int,
    chunk_rows: int | None = None,
    *,
    multiplier: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return `chunked_linear_ce`'s three values, the top_k token ids [N, top_k] of each row's logits (largest
    first) and their log-probabilities [N, top_k] (fp32 or wider, detached), found in the same pass over the
    lm_head."""
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    return _ChunkedLinearCE.apply(hidden, weight.detach(), labels, scale.detach(), rows, float(multiplier),
                                  None if softcap is None else float(softcap), int(top_k))


def chunked_linear_ce_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: int | None = None,
    *,
    top_k: int = 0,
    multiplier: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (CE_i [N] (fp32 or wider), differentiable in hidden, argmax_i [N], top_k ids [N, top_k], their
    log-probabilities [N, top_k], detached) for logits f(hidden [N, H] @ weight.T).

    For losses whose row weights are computed from the CE itself (D-PACE): sum_i w_i * CE_i backpropagates
    through the rows' gradients formed in forward; like `chunked_linear_ce`, never more than one chunk of logits.
    """
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    return _ChunkedLinearCERows.apply(hidden, weight.detach(), labels, rows, float(multiplier),
                                      None if softcap is None else float(softcap), int(top_k))


class _CandidateLogits(torch.autograd.Function):
    """out[i, j] = hidden_i . weight[ids[i, j]]; the gathered weight rows are never saved (recomputed in backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, chunk_rows):  # type: ignore[override]
        w = weight.to(hidden.dtype)
        out = torch.empty(ids.shape, dtype=hidden.dtype, device=hidden.device)
        for s in range(0, ids.shape[0], chunk_rows):
            e = min(ids.shape[0], s + chunk_rows)
            out[s:e] = torch.bmm(w[ids[s:e]], hidden[s:e, :, None])[..., 0]
        ctx.save_for_backward(ids)
        ctx.weight, ctx.dtype, ctx.chunk_rows = w, hidden.dtype, chunk_rows
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        w, rows = ctx.weight, ctx.chunk_rows
        grad = torch.empty(ids.shape[0], w.shape[1], dtype=ctx.dtype, device=ids.device)
        for s in range(0, ids.shape[0], rows):
            e = min(ids.shape[0], s + rows)
            grad[s:e] = torch.bmm(g[s:e, None, :].to(ctx.dtype), w[ids[s:e]])[:, 0]
        return grad, None, None, None


def candidate_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                     chunk_rows: int | None = None) -> torch.Tensor:
    """Return the raw logits [N, K] of chosen tokens ids [N, K]: hidden [N, H] times those rows of the frozen weight
    [V, H], differentiable in hidden; memory stays at one chunk of gathered rows (about 1 GiB), in backward too."""
    rows = chunk_rows or max(1, _CHUNK_BYTES // max(1, ids.shape[1] * weight.shape[1] * 4))
    return _CandidateLogits.apply(hidden, weight.detach(), ids, rows)
