"""Objective: anchors, block inputs, labels, weights, masks, chunked cross-entropy and metrics on small cases."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from dflash.drafter.attention import bucket, dense_masks
from dflash.drafter.linear_ce import chunked_linear_ce, chunked_linear_ce_rows
from dflash.drafter.config import DrafterConfig
from dflash.train.objective import Metrics, block_metrics
from dflash.train.packing import block_quotas, decay_weights, max_blocks_for, pack_batch, sample_anchors


def _seq(mask: list[int], H: int = 4, start: int = 10) -> dict:
    T = len(mask)
    return dict(
        input_ids=torch.arange(start, start + T),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        features=torch.randn(T, 5, H),
    )


def _cfg(B: int = 4, sliding: int | None = None) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=4, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=2, vocab_size=64, block_size=B, mask_token_id=63,
        layer_types=("sliding_attention", "full_attention") if sliding else (), sliding_window=sliding,
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_anchors", [1, 3, 512])
def test_anchors_follow_the_validity_rule(seed: int, max_anchors: int) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(40, generator=g) > 0.3
    a = sample_anchors(mask, max_anchors, torch.Generator().manual_seed(seed))
    allowed = {p for p in range(39) if mask[p] and mask[p + 1]}
    assert set(a.tolist()) <= allowed
    assert a.tolist() == sorted(set(a.tolist()))  # sorted, no repeats
    assert a.numel() == min(max_anchors, len(allowed))
    again = sample_anchors(mask, max_anchors, torch.Generator().manual_seed(seed))
    assert torch.equal(a, again)


def test_anchor_sampling_covers_all_candidates_across_seeds() -> None:
    mask = torch.ones(12, dtype=torch.bool)
    seen = set()
    for seed in range(40):
        seen |= set(sample_anchors(mask, 2, torch.Generator().manual_seed(seed)).tolist())
    assert seen == set(range(11))  # uniform draw, not always the first ones


def test_decay_weights_by_hand() -> None:
    w = decay_weights(16)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[2]), math.exp(-1 / 7), rel_tol=1e-6)
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)
    assert math.isclose(float(decay_weights(8)[3]), math.exp(-2 / 4), rel_tol=1e-6)
    assert math.isclose(float(decay_weights(10)[2]), math.exp(-1 / 5), rel_tol=1e-6)


def test_block_inputs_labels_and_weights() -> None:
    # positions:   0  1  2  3  4  5  6
    s = _seq([0, 1, 1, 1, 0, 1, 1])  # candidates: 1, 2, 5
    b = pack_batch([s], block_size=4, mask_token_id=63, max_anchors=512, seed=0)
    assert b.anchor_pos.tolist() == [1, 2, 5]
    assert b.block_ids.tolist() == [[11, 63, 63, 63], [12, 63, 63, 63], [15, 63, 63, 63]]
    assert b.block_pos.tolist() == [[1, 2, 3, 4], [2, 3, 4, 5], [5, 6, 7, 8]]
    assert b.labels.tolist() == [[11, 12, 13, 14], [12, 13, 14, 15], [15, 16, 0, 0]]
    d = decay_weights(4)
    expect = torch.stack([d * torch.tensor([0, 1, 1, 0]), d * torch.tensor([0, 1, 0, 1]), d * torch.tensor([0, 1, 0, 0])])
    assert torch.equal(b.weights, expect)
    # the context stops before the last anchor: the last block cannot see further
    assert b.features.shape == (5, 20) and b.ctx_pos.tolist() == [0, 1, 2, 3, 4]


def _expected_visibility(lengths_and_anchors, B: int, window: int | None) -> list[list[bool]]:
    """Enumerate, from the rule's words, which key each query may see (keys: contexts, then blocks)."""
    keys = []
    for s, (n_ctx, anchors) in enumerate(lengths_and_anchors):
        keys += [("ctx", s, p, None) for p in range(n_ctx)]
    queries = []
    blk = 0
    for s, (_, anchors) in enumerate(lengths_and_anchors):
        for a in anchors:
            queries += [(s, a, a + k, blk) for k in range(B)]
            blk += 1
    keys += [("blk", s, p, b) for (s, a, p, b) in queries]
    rows = []
    for (s, a, qp, b) in queries:
        row = []
        for (kind, ks, kp, kb) in keys:
            ok = (kind == "ctx" and ks == s and kp < a) or (kind == "blk" and kb == b)
            if window is not None and abs(qp - kp) >= window:
                ok = False
            row.append(ok)
        rows.append(row)
    return rows


@pytest.mark.parametrize("window", [None, 3, 6])
def test_mask_each_query_sees_exactly_its_keys(window: int | None) -> None:
    seqs = [_seq([1, 1, 1, 1, 1, 1]), _seq([0, 1, 1, 1, 1]), _seq([1, 0, 1, 1])]
    b = pack_batch(seqs, block_size=3, mask_token_id=63, max_anchors=2, seed=3)
    per_seq = []
    for s in range(3):
        lo, hi = b.cu_blocks[s], b.cu_blocks[s + 1]
        anchors = b.anchor_pos[lo:hi].tolist()
        per_seq.append((int(b.cu_ctx[s + 1] - b.cu_ctx[s]), anchors))
    cfg = _cfg(B=3, sliding=window)
    masks = dense_masks(b, cfg)
    kind = "sliding_attention" if window else "full_attention"
    assert masks[kind].tolist() == _expected_visibility(per_seq, 3, window)
    if window:
        assert masks["full_attention"].tolist() == _expected_visibility(per_seq, 3, None)


@pytest.mark.parametrize("chunk", [1, 3, 7, None])
def test_chunked_ce_equals_full_logits(chunk: int | None) -> None:
    torch.manual_seed(0)
    N, H, V = 7, 5, 11
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, H, dtype=torch.float64)
    labels = torch.randint(0, V, (N,))
    w = torch.rand(N, dtype=torch.float64)
    scale = w / w.sum()
    loss, ce, pred = chunked_linear_ce(h, W, labels, scale, chunk)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    logits = h2 @ W.T
    ref = (F.cross_entropy(logits, labels, reduction="none") * scale).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(ce, F.cross_entropy(logits.detach(), labels, reduction="none"))
    torch.testing.assert_close(h.grad, h2.grad)
    assert torch.equal(pred, logits.argmax(-1))
    # The per-row form (D-PACE weighs rows by their own CE): the weights come after the forward, same gradient.
    h3 = h.detach().clone().requires_grad_(True)
    ce3, pred3, _, _ = chunked_linear_ce_rows(h3, W, labels, chunk)
    (ce3 * scale).sum().backward()
    torch.testing.assert_close(ce3.detach(), ce)
    torch.testing.assert_close(h3.grad, h2.grad)
    assert torch.equal(pred3, pred)


def test_streak_and_tau_hat_by_hand() -> None:
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    counted = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1]], dtype=torch.bool)
    per_slot, count, streak = block_metrics(correct, counted)
    assert per_slot == [2, 3, 1, 3] and count == [3, 3, 2, 3]
    assert streak == 2 + 0 + 2  # an uncounted slot ends the third block's streak
    m = Metrics(ce_sum=3.0, weight_sum=2.0, slot_correct=per_slot, slot_count=count, streak_sum=streak, blocks=3)
    assert m.tau_hat == pytest.approx(1 + 4 / 3)
    assert m.loss == 1.5
    assert m.slot_accuracy == pytest.approx([2 / 3, 1.0, 0.5, 1.0])
    both = m + m
    assert both.tau_hat == m.tau_hat and both.blocks == 6 and both.slot_count == [6, 6, 4, 6]


def test_buckets_are_few_and_cover() -> None:
    sizes = {bucket(n) for n in range(1, 70000, 37)}
    assert all(bucket(n) >= n for n in range(1, 5000))
    assert all(bucket(n) <= max(256, 1.25 * n) for n in range(1, 70000, 13))
    assert len(sizes) <= 40


def test_block_quotas_cap_the_batch_and_scale_every_sequence_alike() -> None:
    assert block_quotas([100, 3, 0], max_anchors=8, max_blocks=None) == [8, 3, 0]
    assert block_quotas([100, 3, 0], max_anchors=8, max_blocks=20) == [8, 3, 0]  # under the cap: untouched
    q = block_quotas([100] * 10 + [4] * 5, max_anchors=8, max_blocks=30)
    # 80 + 20 asked, each cut to 30 % (2.4 and 1.2); the 5 spare blocks go to the largest remainders
    assert sum(q) == 30 and q == [3] * 5 + [2] * 5 + [1] * 5
    q = block_quotas([7, 7, 7], max_anchors=512, max_blocks=10)
    assert q == [4, 3, 3]  # the spare block goes to the earliest of equal remainders
    assert max_blocks_for(16384) == 4096 and max_blocks_for(1) == 1


def test_many_short_sequences_stay_within_the_batch_block_cap() -> None:
    # 40 answers of 60 tokens with the reference's 512 anchors each would give ~2,300 blocks; the cap keeps 100.
    seqs = [_seq([0] * 4 + [1] * 56, start=s) for s in range(40)]
    free = pack_batch(seqs, block_size=4, mask_token_id=63, max_anchors=512, seed=5)
    capped = pack_batch(seqs, block_size=4, mask_token_id=63, max_anchors=512, max_blocks=100, seed=5)
    assert free.num_blocks == 40 * 55 and capped.num_blocks == 100
    per_seq = (capped.cu_blocks[1:] - capped.cu_blocks[:-1]).tolist()
    assert per_seq == [3] * 20 + [2] * 20
    again = pack_batch(seqs, block_size=4, mask_token_id=63, max_anchors=512, max_blocks=100, seed=5)
    assert torch.equal(again.anchor_pos, capped.anchor_pos)  # still a pure function of (sequences, seed)
