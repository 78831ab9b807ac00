"""DDTree: the heap against brute force, the tree tau metric against a direct walk of the heap's tree, the tree and
acceptance losses (their gradients, resume after SIGKILL; 2 gloo ranks == 1 rank is test_dpace's, with them)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.nn import functional as F

from dflash.drafter.attention import make_attend
from dflash.targets.head import load_target_head
from dflash.drafter.tree import best_scores, build_tree
from dflash.train.objective import predict
from dflash.train.packing import pack_batch
from dflash.train.tree_loss import tree_terms
from test_drafter import _drafter, _sequences
from test_train_run import sigkill_and_resume


def _paths(tree) -> list[tuple[int, ...]]:
    out = []
    for n in range(len(tree)):
        p, path = n, []
        while p >= 0:
            path.append(tree.tokens[p])
            p = tree.parents[p]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_heap_pops_the_n_best_prefixes_as_brute_force_finds_them(seed) -> None:
    g = torch.Generator().manual_seed(seed)
    D, V = 4, 5
    lp = torch.log_softmax(torch.randn(D, V, generator=g, dtype=torch.float64) * 2, -1)
    everything = sorted(((sum(float(lp[i, t]) for i, t in enumerate(toks)), toks)
                         for d in range(1, D + 1) for toks in itertools.product(range(V), repeat=d)), reverse=True)
    values, ids = lp.sort(-1, descending=True)
    for n in (1, 2, 5, 13, 40):
        tree = build_tree(values, ids, n)
        assert set(_paths(tree)) == {t for _, t in everything[:n]}
        assert all(tree.parents[i] < i for i in range(n))  # ancestors first
        best = best_scores(values[None], n)[0]
        torch.testing.assert_close(best, torch.tensor([s for s, _ in everything[:n]], dtype=best.dtype))
    # A slot without a distribution (-inf) takes no node, nor does anything below it.
    cut = values.clone()
    cut[2:] = float("-inf")
    assert max(build_tree(cut, ids, 40).depths) == 2 and len(build_tree(cut, ids, 40)) == V + V * V


def _full_logits(model, head, batch):
    emb = F.embedding(batch.block_ids.reshape(-1), head.embed)
    hidden = model(batch.features, batch.ctx_pos, emb, batch.block_pos.reshape(-1),
                   make_attend(batch, model.config, "sdpa", None))
    return hidden.view(batch.num_blocks, batch.block_size, -1)[:, 1:] @ head.lm_head.T  # [A, D, V] float64


def test_tree_tau_equals_walking_the_heaps_tree_block_by_block(tiny_qwen3) -> None:
    model = _drafter(tiny_qwen3)
    head = load_target_head(tiny_qwen3, dtype=torch.float64)
    batch = pack_batch(_sequences(model.config.hidden_size, model.config.vocab_size), block_size=5,
                       mask_token_id=model.config.mask_token_id, max_anchors=8, seed=0)
    budgets = (1, 3, 8, 20)
    with torch.no_grad():
        p = predict(model, batch, head.embed, head.lm_head, chunk_rows=7, tree_budgets=budgets)
        lp = torch.log_softmax(_full_logits(model, head, batch), -1)
    counted = batch.weights[:, 1:] > 0
    labels = batch.labels[:, 1:]
    expect = []
    for b in range(batch.num_blocks):
        prefix = int(torch.cumprod(counted[b].int(), 0).sum())  # the tree grows on the leading counted slots
        values, ids = lp[b].sort(-1, descending=True)
        values[prefix:] = float("-inf")
        gold = tuple(labels[b, :prefix].tolist())
        row = []
        for n in budgets:
            nodes = set(_paths(build_tree(values, ids, n)))
            row.append(max([d for d in range(prefix + 1) if gold[:d] in nodes or d == 0]))
        expect.append(row)
    assert p.tree_depths.tolist() == expect
    assert any(r[0] < r[-1] for r in expect)  # a larger tree reaches deeper somewhere: the test has teeth
    # A tree of 1 node is slot 1's argmax: depth 1 where it is right.
    assert p.tree_depths[:, 0].tolist() == (p.correct & counted)[:, 0].int().tolist()


def test_tree_and_acceptance_losses_equal_their_formulas_and_reach_only_the_prefix() -> None:
    g = torch.Generator().manual_seed(3)
    A, D, V, N = 3, 4, 6, 5
    logits = torch.randn(A, D, V, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (A, D), generator=g)
    counted = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    rows = torch.nonzero(counted.reshape(-1))[:, 0]
    lp = torch.log_softmax(logits, -1)
    ce = -lp.gather(2, labels[..., None])[..., 0].reshape(-1)[rows]
    top = lp.detach().reshape(A * D, V)[rows].sort(-1, descending=True).values
    w = torch.rand(A, D, generator=g, dtype=torch.float64).reshape(-1)[rows]
    t = tree_terms(ce, top, rows, counted, w, tree_budget=N, accept=True)
    # By hand: prefixes 4, 2 and 0 slots long; tau_N from the heap of each block's tree on its prefix slots.
    want_tree, want_accept = 0.0, 0.0
    wg = torch.zeros(A * D, dtype=torch.float64).index_copy(0, rows, w).view(A, D)
    for b, prefix in enumerate((4, 2, 0)):
        if prefix == 0:
            continue
        values, ids = lp[b, :prefix].detach().sort(-1, descending=True)
        tau = build_tree(values, ids, N).scores[-1]
        s = torch.cumsum(lp[b, :prefix].gather(1, labels[b, :prefix, None])[:, 0], 0)
        want_tree = want_tree + (F.softplus(tau - s) * wg[b, :prefix]).sum()
        want_accept = want_accept - torch.exp(s).sum()
    torch.testing.assert_close(t.tree_sum, want_tree)
    torch.testing.assert_close(t.accept_sum, want_accept)
    for term in (t.tree_sum, t.accept_sum):
        (grad,) = torch.autograd.grad(term, logits, retain_graph=True)
        reached = grad.abs().sum(-1) > 0
        # Every slot of a counted prefix, none after a slot that does not count, none of a block that starts there.
        assert reached.tolist() == [[True] * 4, [True, True, False, False], [False] * 4]


def test_a_tree_loss_run_logs_its_terms_and_tree_tau_and_resumes_after_sigkill(store, tiny_qwen3, tmp_path) -> None:
    from dflash.train.metrics import read_metrics

    kw = dict(epochs=1, batch_tokens=256, save_every=2, keep=3, block_size=4, tree_loss=8, accept_loss=True,
              position_weights="decay", tree_budgets=(4, 8))
    full = sigkill_and_resume(store, tiny_qwen3, tmp_path, kw)
    steps = [r for r in read_metrics(full) if r.get("split") == "train"]
    assert all(r["loss_tree"] > 0 and r["loss_accept"] < 0 and math.isfinite(r["loss"]) for r in steps)
    vals = [r for r in read_metrics(full) if r.get("split") == "val"]
    assert vals and all(r["tree_budgets"] == [4, 8] and 1.0 <= r["tau_hat"] <= r["tree_tau"][0] <= r["tree_tau"][1]
                        for r in vals)


def test_dflash2s_selector_tree_depth_equals_enumerating_every_path_of_its_candidates(tiny_qwen3) -> None:
    """The selector's tree (children: the slot's top-K candidates, scored by the log-softmax of the selector's scores
    given the parent's token): its N best prefixes by brute force over every path, against the batched metric."""
    from dflash.drafter.model import unary_logits
    from test_dpace import dflash2_batch

    model, head, batch = dflash2_batch(tiny_qwen3, top_k=3, std=0.5, selector_rank=8)
    cfg = model.config
    budgets = (1, 4, 12)
    with torch.no_grad():
        emb = F.embedding(batch.block_ids.reshape(-1), head.embed)
        hidden = model(batch.features, batch.ctx_pos, emb, batch.block_pos.reshape(-1),
                       make_attend(batch, cfg, "sdpa", None)).view(batch.num_blocks, 5, -1)[:, 1:]
        logits = unary_logits(cfg, hidden @ head.lm_head.T)
        # Gold tokens among the candidates in every other block (random labels almost never are), at random ranks.
        g = torch.Generator().manual_seed(1)
        picks = torch.topk(logits, 3, dim=-1).indices.gather(2, torch.randint(0, 3, (*logits.shape[:2], 1), generator=g))
        batch.labels[::2, 1:] = picks[::2, :, 0]
        p = predict(model, batch, head.embed, head.lm_head, tree_budgets=budgets)
    sel = model.candidate_selector
    counted = batch.weights[:, 1:] > 0
    expect = []
    for b in range(batch.num_blocks):
        prefix = int(torch.cumprod(counted[b].int(), 0).sum())
        unary, cands = torch.topk(logits[b], 3, dim=-1)

        def logp(d: int, prev: int) -> torch.Tensor:
            pred = torch.tensor([prev] * 3)
            return sel.scores(hidden[b, d].expand(3, -1), unary[d][None].expand(3, -1), cands[d][None].expand(3, -1),
                              pred)[0].log_softmax(-1)

        paths = []  # (score, tokens) of every prefix through the candidates
        for d in range(1, prefix + 1):
            for picks in itertools.product(range(3), repeat=d):
                toks = [int(cands[i, k]) for i, k in enumerate(picks)]
                before = [int(batch.block_ids[b, 0])] + toks
                paths.append((sum(float(logp(i, before[i])[k].detach()) for i, k in enumerate(picks)), tuple(toks)))
        paths.sort(reverse=True)
        gold = tuple(batch.labels[b, 1:1 + prefix].tolist())
        expect.append([max([d for d in range(prefix + 1) if d == 0 or gold[:d] in {t for _, t in paths[:n]}])
                       for n in budgets])
    assert p.selector_tree_depths.tolist() == expect
    assert any(r[-1] > 0 for r in expect)  # some gold prefix is in a tree: the comparison has teeth
