"""tau parity: teacher-forced drafting at the anchors a decoding used gives back the tau it measured."""
from __future__ import annotations

import pytest
import torch

from dflash.facts import build_target_layer_ids
from dflash.drafter.decode import (
    block_anchors,
    compare_on_prompts,
    drafter_proposer,
    greedy_decode,
    load_target,
    speculative_decode,
    summarize,
    teacher_forced,
)
from dflash.drafter.model import DFlashDrafter, DrafterConfig

PROMPT = [200, 1, 42, 42, 7, 8, 250, 11, 60]


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(tiny_qwen3)


@pytest.fixture(scope="module")
def layer_ids(target):
    return build_target_layer_ids(target.config.num_hidden_layers)


def _known(prompt, reference, block_size, wrong: bool):
    """A proposer that drafts the target's own greedy continuation (the oracle), or that shifted by one (never right)."""

    def propose(context, anchor_id, anchor_pos):
        done = anchor_pos - len(prompt) + 1  # answer tokens up to and including the anchor
        drafts = list(reference[done: done + block_size - 1])
        drafts += [0] * (block_size - 1 - len(drafts))
        return torch.tensor([(d + 1) % 259 for d in drafts] if wrong else drafts)

    return propose


@pytest.mark.parametrize("block_size,n", [(4, 23), (6, 24), (5, 1)])
def test_oracle_and_always_wrong_proposers_give_the_known_tau_both_ways(target, layer_ids, block_size, n):
    reference = greedy_decode(target, PROMPT, max_new_tokens=n + 8).tokens  # the oracle knows past the cut
    kw = dict(block_size=block_size, layer_ids=layer_ids)
    for wrong in (False, True):
        propose = _known(PROMPT, reference, block_size, wrong)
        spec = speculative_decode(target, propose, PROMPT, max_new_tokens=n, **kw)
        assert spec.tokens == reference[:n]
        blocks = -(-(n - 1) // (1 if wrong else block_size))  # every block gains B (1 if always wrong), the last less
        want = [1] * (n - 1) if wrong else [block_size] * (blocks - 1) + [n - 1 - block_size * (blocks - 1)]
        assert spec.accepted == (want if n > 1 else [])
        same = teacher_forced(target, propose, PROMPT, spec.tokens, anchors=block_anchors(spec), **kw)
        assert same.anchors == block_anchors(spec) and same.gains == spec.accepted and same.tau == spec.tau
        if wrong:
            assert same.tau_hat == same.tau == spec.tau == (1.0 if n > 1 else 0.0)
        elif n > 1:
            # Teacher forcing credits the last block with a bonus token past the answer's end; decoding cannot.
            assert same.streaks[-1] == spec.accepted[-1] and same.tau_hat == pytest.approx(spec.tau + 1 / blocks)
        every = teacher_forced(target, propose, PROMPT, spec.tokens, **kw)
        assert every.anchors == list(range(n - 1))
        assert every.streaks == ([0] * (n - 1) if wrong else [min(block_size - 1, n - 1 - i) for i in range(n - 1)])


def _fitted_drafter(tiny_qwen3, target, layer_ids, answers, block_size=4, steps=150):
    """Return a drafter trained by the training objective on the target's greedy answers to PROMPTS (overfit on
    purpose: it must accept some blocks and miss others)."""
    from dflash.drafter.target_head import load_target_head
    from dflash.train.objective import drafter_loss, pack_batch

    cfg = DrafterConfig.from_target(tiny_qwen3, target_layer_ids=layer_ids, mask_token_id=259, draft_layers=1,
                                    block_size=block_size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    head = load_target_head(tiny_qwen3, dtype=torch.float32)
    seqs = []
    for prompt, answer in zip(PROMPTS, answers):
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        mask = torch.zeros(ids.shape[1], dtype=torch.bool)
        mask[len(prompt):] = True
        seqs.append({"input_ids": ids[0], "loss_mask": mask, "features": torch.cat([hs[i + 1][0] for i in layer_ids], -1)})
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for step in range(steps):
        batch = pack_batch(seqs, block_size=block_size, mask_token_id=259, max_anchors=16, seed=step)
        loss, _ = drafter_loss(drafter, batch, head.embed, head.lm_head)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


PROMPTS = [PROMPT, [5, 17, 99, 3]]


def test_a_trained_drafters_teacher_forced_gains_equal_what_decoding_accepted(tiny_qwen3, target, layer_ids):
    answers = [greedy_decode(target, p, max_new_tokens=40).tokens for p in PROMPTS]
    drafter = _fitted_drafter(tiny_qwen3, target, layer_ids, answers)
    propose = drafter_proposer(drafter, target)
    spec = speculative_decode(target, propose, PROMPT, block_size=4, layer_ids=layer_ids, max_new_tokens=40)
    assert spec.tokens == answers[0]
    assert 1 in spec.accepted and max(spec.accepted) > 1  # some blocks accepted, some not: a real test of parity
    same = teacher_forced(target, propose, PROMPT, spec.tokens, block_size=4, layer_ids=layer_ids,
                          anchors=block_anchors(spec))
    assert same.gains == spec.accepted  # the decoding loop gives the drafter what training's features give it

    report = compare_on_prompts(target, drafter, PROMPTS, max_new_tokens=40, parity=True)
    assert report["blocks_differ"] == 0 and report["tau_forced_same_anchors"] == pytest.approx(report["tau"])
    assert report["anchors_every"] == 2 * 39 and report["tau_hat_every_anchor"] >= 1.0
    assert report["tau_hat_same_anchors"] >= report["tau"]
    assert report["speedup_wall_clock"] == pytest.approx(report["seconds_greedy"] / report["seconds_speculative"])


def test_the_projection_cache_starts_again_for_another_context(tiny_qwen3, target, layer_ids):
    cfg = DrafterConfig.from_target(tiny_qwen3, target_layer_ids=layer_ids, mask_token_id=259, draft_layers=1,
                                    block_size=4)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    cached, fresh = drafter_proposer(drafter, target), lambda: drafter_proposer(drafter, target)
    torch.manual_seed(2)
    a, b = torch.randn(12, cfg.hidden_size * len(layer_ids)), torch.randn(9, cfg.hidden_size * len(layer_ids))
    # Growing, shrinking, and switching contexts through one proposer give what a new proposer gives each time.
    for feats, pos in ((a[:5], 5), (a[:8], 8), (a, 12), (a, 7), (b, 9), (a[:6], 6), (b[:9], 9)):
        assert torch.equal(cached(feats, 3, pos), fresh()(feats, 3, pos))


def test_summarize_says_the_wall_clock_speed_up_beside_the_forwards_one():
    rows = [dict(tau=2.0, blocks=3, tokens=7, forwards_greedy=7, forwards_speculative=4, identical=True,
                 seconds_greedy=1.0, seconds_speculative=2.0)]
    out = summarize(rows)
    assert out["speedup_forwards"] == pytest.approx(7 / 4) and out["speedup_wall_clock"] == pytest.approx(0.5)
    assert "tau_hat_same_anchors" not in out  # no parity fields unless the rows carry them
