"""A weighted cross-entropy through a frozen lm_head that never holds more than one chunk of logits."""
from __future__ import annotations

import logging

import torch

__all__ = ["chunked_linear_ce", "chunked_linear_ce_rows", "default_chunk_rows"]

log = logging.getLogger(__name__)

# About 1 GiB of fp32 logits per chunk: small next to an H200, large enough to keep the matmuls efficient.
_CHUNK_BYTES = 1 << 30


def default_chunk_rows(vocab_size: int) -> int:
    """Return the rows per chunk that keep one chunk of fp32 logits near 1 GiB (a multiple of 128, >= 128)."""
    return max(128, (_CHUNK_BYTES // (4 * vocab_size)) // 128 * 128)


def _chunked_ce(hidden, weight, labels, scale, chunk_rows, need_grad):
    """Return (CE_i, argmax_i, d sum_i scale_i CE_i / d hidden or None), one chunk of logits alive at a time.

    scale None: the gradient of each row's own CE (unscaled), for a caller whose weights depend on the CE.
    """
    n = hidden.shape[0]
    w = weight.to(hidden.dtype)
    grad = torch.empty_like(hidden) if need_grad else None
    acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax in fp32 at least (fp64 stays exact)
    ce = torch.empty(n, dtype=acc, device=hidden.device)
    pred = torch.empty(n, dtype=torch.long, device=hidden.device)
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        logits = (hidden[s:e] @ w.T).to(acc)
        lab = labels[s:e, None]
        lse = torch.logsumexp(logits, dim=-1)
        ce[s:e] = lse - logits.gather(1, lab)[:, 0]
        pred[s:e] = logits.argmax(dim=-1)
        if need_grad:
            # softmax - onehot, scaled by each row's loss weight, in place to keep one chunk of logits alive.
            probs = logits.sub_(lse[:, None]).exp_()
            probs.scatter_add_(1, lab, torch.full_like(lab, -1, dtype=probs.dtype))
            if scale is not None:
                probs.mul_(scale[s:e, None].to(acc))
            grad[s:e] = probs.to(hidden.dtype) @ w
        del logits
    return ce, pred, grad


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_i scale_i * CE(hidden_i @ weight.T, label_i); the input gradient is formed chunk by chunk in forward.

    Because weight is frozen and the loss is the only consumer of the logits, the gradient of each chunk is known
    as soon as its softmax is: computing it there costs one more matmul and no recomputation in backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, chunk_rows):  # type: ignore[override]
        need_grad = ctx.needs_input_grad[0]
        ce, pred, grad = _chunked_ce(hidden, weight, labels, scale, chunk_rows, need_grad)
        loss = (ce * scale.to(ce.dtype)).sum()
        ctx.mark_non_differentiable(ce, pred)
        if need_grad:
            ctx.save_for_backward(grad)
        return loss, ce, pred

    @staticmethod
    def backward(ctx, g_loss, g_ce, g_pred):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * g_loss.to(grad.dtype), None, None, None, None


class _ChunkedLinearCERows(torch.autograd.Function):
    """CE(hidden_i @ weight.T, label_i) per row, differentiable: each row's gradient is formed in forward, unscaled,
    and scaled in backward by the weight the caller put on that row (known only once the CE is)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows):  # type: ignore[override]
        need_grad = ctx.needs_input_grad[0]
        ce, pred, grad = _chunked_ce(hidden, weight, labels, None, chunk_rows, need_grad)
        ctx.mark_non_differentiable(pred)
        if need_grad:
            ctx.save_for_backward(grad)
        return ce, pred

    @staticmethod
    def backward(ctx, g_ce, g_pred):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        # The product in fp32: the rows' weights span orders of magnitude, bf16 would round them twice.
        return (grad.float() * g_ce.float()[:, None]).to(grad.dtype), None, None, None


def chunked_linear_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (sum_i scale_i * CE_i, CE_i [N] (fp32 or wider) detached, argmax_i [N]) for logits hidden [N, H] @ weight.T.

    weight [V, H] is frozen (no gradient); scale [N] holds each row's loss weight already divided by the batch's
    weight total. Peak extra memory is one chunk of fp32 logits, never [N x V].
    """
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    return _ChunkedLinearCE.apply(hidden, weight.detach(), labels, scale.detach(), rows)


def chunked_linear_ce_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (CE_i [N] (fp32 or wider), differentiable in hidden, argmax_i [N]) for logits hidden [N, H] @ weight.T.

    For losses whose row weights are computed from the CE itself (D-PACE): sum_i w_i * CE_i backpropagates
    through the rows' gradients formed in forward; like `chunked_linear_ce`, never more than one chunk of logits.
    """
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    return _ChunkedLinearCERows.apply(hidden, weight.detach(), labels, rows)
