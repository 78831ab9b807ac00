"""D-PACE position weights: the paper's formula by hand, detached weights, the loss and its gradient against full
logits, a global denominator (2 gloo ranks with uneven anchors == 1 rank accumulating both, also with the tree and
acceptance terms), options and resume."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from dflash.config import DemoConfig, TrainConfig
from dflash.drafter.attention import make_attend
from dflash.targets.head import load_target_head
from dflash.errors import ConfigError, ManifestMismatch
from dflash.train.run_folder import check_resume
from dflash.train.objective import dpace_weights, loss_denominator, predict
from dflash.train.packing import pack_batch
from test_drafter import _drafter, _sequences
from test_train_run import opts, train


def test_dpace_weights_by_hand() -> None:
    # Two blocks of B=4; slot 0 is the anchor. Confidences q = exp(-CE); alpha 0.5: q~ = 0.5 q + 0.5.
    # Block 0, slots 1..3 valid, q = 1, 0.5, 0.2 -> q~ = 1, 0.75, 0.6; prefix products 1, 0.75, 0.45;
    #   w3 = 0.45, w2 = 0.75 + 0.45 = 1.2, w1 = 1 + 0.75 + 0.45 = 2.2.
    # Block 1, slot 2 outside the loss mask (its CE is ignored, q~ = 1), q1 = 0.6, q3 = 0.2 -> q~ = 0.8, 1, 0.6;
    #   prefix 0.8, 0.8, 0.48 over valid slots 1 and 3: w1 = 0.8 + 0.48 = 1.28, w2 = 0, w3 = 0.48.
    ce = torch.tensor([[3.0, 0.0, math.log(2), math.log(5)],
                       [1.0, -math.log(0.6), 7.0, math.log(5)]], dtype=torch.float64)
    valid = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 1]], dtype=torch.bool)
    w = dpace_weights(ce, valid, alpha=0.5)
    expect = torch.tensor([[0.0, 2.2, 1.2, 0.45], [0.0, 1.28, 0.0, 0.48]], dtype=torch.float64)
    torch.testing.assert_close(w, expect)
    # alpha 1 ignores the confidences: w_j is the number of valid slots from j on (a linear decay).
    torch.testing.assert_close(dpace_weights(ce, valid, alpha=1.0),
                               torch.tensor([[0.0, 3, 2, 1], [0, 2, 0, 1]], dtype=torch.float64))
    # Past the sequence end (slots invalid to the block's end), the earlier weights keep their value.
    cut = valid.clone()
    cut[0, 3] = False
    torch.testing.assert_close(dpace_weights(ce, cut, 0.5)[0], torch.tensor([0.0, 1.75, 0.75, 0.0],
                                                                            dtype=torch.float64))


def test_dpace_weights_are_detached() -> None:
    ce = torch.rand(3, 5, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(3, 5, dtype=torch.bool)
    w = dpace_weights(ce, valid)
    assert not w.requires_grad and w.grad_fn is None
    (w * ce).sum().backward()
    torch.testing.assert_close(ce.grad, w)  # the gradient of sum w CE is w itself: none flows through w


def test_dpace_loss_and_gradient_equal_a_full_logits_reference(tiny_qwen3) -> None:
    model = _drafter(tiny_qwen3)
    head = load_target_head(tiny_qwen3, dtype=torch.float64)
    seqs = _sequences(model.config.hidden_size, model.config.vocab_size)
    batch = pack_batch(seqs, block_size=5, mask_token_id=model.config.mask_token_id, max_anchors=8, seed=0)
    p = predict(model, batch, head.embed, head.lm_head, chunk_rows=7, position_weights="dpace", dpace_alpha=0.3)
    p.loss.backward()
    got = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    emb = F.embedding(batch.block_ids.reshape(-1), head.embed)
    hidden = model(batch.features, batch.ctx_pos, emb, batch.block_pos.reshape(-1),
                   make_attend(batch, model.config, "sdpa", None))
    logits = hidden.view(batch.num_blocks, batch.block_size, -1)[:, 1:] @ head.lm_head.T  # float64 throughout
    counted = batch.weights[:, 1:] > 0
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels[:, 1:].flatten(), reduction="none").view_as(counted)
    q = torch.exp(-ce.detach())
    smooth = torch.where(counted, 0.7 * q + 0.3, torch.ones_like(q))
    reach = torch.cumprod(smooth, 1) * counted
    w = torch.stack([reach[:, j:].sum(1) for j in range(reach.shape[1])], 1) * counted
    blocks = int(counted.any(1).sum())
    ref = (w * ce).sum() / blocks
    ref.backward()
    torch.testing.assert_close(p.loss.detach(), ref.detach())
    for n, q in model.named_parameters():
        torch.testing.assert_close(got[n], q.grad, msg=n)
    m = p.metrics()
    assert m.weight_sum == blocks == loss_denominator(batch.weights, "dpace")
    assert m.loss == pytest.approx(float(ref.detach()))
    assert m.slot_mean_weight[0] >= m.slot_mean_weight[-1] > 0  # an earlier slot has at least a later one's credit
    assert loss_denominator(batch.weights, "decay") == pytest.approx(float(batch.weights[:, 1:].sum()))


# -- the global denominator ------------------------------------------------------------------------------------
LENGTHS = ((23, 31, 17), (6,))  # the two micro-batches of one global batch: many anchors, then few


def _micro(dcfg, index: int):
    seqs = _sequences(dcfg.hidden_size, dcfg.vocab_size, lengths=LENGTHS[index], dtype=torch.float32, seed=index)
    return pack_batch(seqs, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id, max_anchors=8,
                      seed=index)


# Every objective whose loss is normalised globally: the position weights, and the tree and acceptance terms
# (train/tree_loss.py) over them.
OBJECTIVES = {"decay": dict(position_weights="decay"), "dpace": dict(position_weights="dpace"),
              "decay+tree": dict(position_weights="decay", tree_loss=6),
              "dpace+accept+tree": dict(position_weights="dpace", accept_loss=True, tree_loss=3)}


def _learner_grads(target: str, micro: list[int], report=None) -> dict:
    """Return {objective: this rank's gradients and summed metrics} after Learner.backward over its micro-batches."""
    from dflash.drafter.config import DrafterConfig
    from dflash.facts import build_target_layer_ids
    from dflash.train.dist import Dist
    from dflash.train.learner import Learner

    dcfg = DrafterConfig.from_target(target, target_layer_ids=build_target_layer_ids(8), mask_token_id=262,
                                     draft_layers=1, block_size=5)
    dist = Dist.setup("cpu")
    out = {}
    for name, objective in OBJECTIVES.items():
        cfg = TrainConfig(store="unused", target=target, out="unused", gpus="cpu", dtype="float32", draft_layers=1,
                          block_size=5, **objective)
        learner = Learner(cfg, dcfg, dist)
        metrics = learner.backward([_micro(dcfg, i) for i in micro])
        out[name] = {"grads": {n: p.grad.numpy().copy() for n, p in learner.model.named_parameters()},
                          "metrics": metrics.to_tensor().numpy()}
    out["blocks"] = [_micro(dcfg, i).num_blocks for i in micro]
    dist.close()
    return out


def test_two_gloo_ranks_with_uneven_anchors_equal_one_rank_accumulating_both(tiny_qwen3) -> None:
    from dflash.runtime.process import launch

    one = _learner_grads(str(tiny_qwen3), [0, 1])
    ranks = launch(_learner_grads, [(str(tiny_qwen3), [0]), (str(tiny_qwen3), [1])], what="test rank",
                   dist_env=True)
    assert ranks[0]["blocks"][0] > 3 * ranks[1]["blocks"][0]  # uneven anchors per rank
    for objective in OBJECTIVES:
        for name, g in one[objective]["grads"].items():
            for r in ranks:
                torch.testing.assert_close(torch.from_numpy(r[objective]["grads"][name]), torch.from_numpy(g),
                                           rtol=1e-6, atol=1e-9, msg=f"{objective} {name}")
        summed = torch.from_numpy(ranks[0][objective]["metrics"] + ranks[1][objective]["metrics"])
        torch.testing.assert_close(summed, torch.from_numpy(one[objective]["metrics"]))
        # The metrics vector ends with the tree and acceptance sums: present exactly where the objective has them.
        assert (one[objective]["metrics"][-2] != 0) == ("tree" in objective)
        assert (one[objective]["metrics"][-1] != 0) == ("accept" in objective)


def test_a_rank_local_denominator_would_change_the_gradient(tiny_qwen3) -> None:
    # The check above has teeth: each micro-batch normalised by its own denominator, then averaged (what DDP does
    # with rank-local losses), gives another gradient on the same uneven global batch.
    model = _drafter(tiny_qwen3, dtype=torch.float32)
    head = load_target_head(tiny_qwen3)
    batches = [_micro(model.config, i) for i in (0, 1)]

    def grad(local: bool) -> torch.Tensor:
        model.zero_grad()
        dens = [loss_denominator(b.weights, "dpace") for b in batches]
        for b, d in zip(batches, dens):
            p = predict(model, b, head.embed, head.lm_head, position_weights="dpace")
            (p.loss * (0.5 if local else d / sum(dens))).backward()
        return torch.cat([q.grad.flatten() for q in model.parameters()])

    assert not torch.allclose(grad(local=True), grad(local=False), rtol=1e-3)


# -- options, record, resume -----------------------------------------------------------------------------------
def test_position_weight_options_are_checked() -> None:
    base = dict(store="s", target="t", out="o")
    # D-PACE is the default since the A/B on one H200 (bench/RESULTS.md, "DFlash 2 and D-PACE").
    assert TrainConfig(**base).position_weights == "dpace" and TrainConfig(**base).dpace_alpha == 0.5
    with pytest.raises(ConfigError, match="--position-weights 'focal': use decay or dpace"):
        TrainConfig(**base, position_weights="focal")
    with pytest.raises(ConfigError, match=r"--dpace-alpha must be in \(0, 1\], got 0"):
        TrainConfig(**base, position_weights="dpace", dpace_alpha=0.0)
    with pytest.raises(ConfigError, match="--dpace-alpha 0.3 applies to --position-weights dpace only"):
        TrainConfig(**base, position_weights="decay", dpace_alpha=0.3)
    assert DemoConfig(position_weights="dpace").position_weights == "dpace"
    with pytest.raises(ConfigError, match="--position-weights"):
        DemoConfig(position_weights="focal")


def test_resume_refuses_other_position_weights_and_takes_a_record_that_predates_them(tmp_path) -> None:
    base = dict(store="s", target="t", out=str(tmp_path))
    decay = {"config": TrainConfig(**base, position_weights="decay").to_dict(), "resolved": {}}
    dpace = {"config": TrainConfig(**base, position_weights="dpace").to_dict(), "resolved": {}}
    with pytest.raises(ManifestMismatch, match='config.position_weights: run has "decay", now "dpace"'):
        check_resume(tmp_path, decay, dpace)
    alpha = {"config": TrainConfig(**base, position_weights="dpace", dpace_alpha=0.7).to_dict(), "resolved": {}}
    with pytest.raises(ManifestMismatch, match="config.dpace_alpha: run has 0.5, now 0.7"):
        check_resume(tmp_path, dpace, alpha)
    old = json.loads(json.dumps(decay))
    del old["config"]["position_weights"], old["config"]["dpace_alpha"]
    check_resume(tmp_path, old, decay)  # a run made before the option trained with decay weights
    with pytest.raises(ManifestMismatch, match='config.position_weights: run has "decay", now "dpace"'):
        check_resume(tmp_path, old, dpace)  # ... so today's default is a change for it
    with pytest.raises(ManifestMismatch, match="config.position_weights"):
        check_resume(tmp_path, old, dpace)


def test_train_with_dpace_records_its_weights_and_resume_refuses_decay(store, tiny_qwen3, tmp_path) -> None:
    from dflash.train.metrics import read_metrics

    run = tmp_path / "run"
    kw = dict(epochs=1, max_steps=4, save_every=2, position_weights="dpace")
    train(**opts(store, tiny_qwen3, run, **kw))
    steps = [r for r in read_metrics(run) if r.get("split") == "train"]
    assert steps and all(r["loss_weights"] == "dpace" and len(r["slot_weight"]) == 7 for r in steps)
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in steps)
    vals = [r for r in read_metrics(run) if r.get("split") == "val"]
    assert vals and all(r["loss_weights"] == "decay" for r in vals)
    assert json.loads((run / "config.json").read_text())["config"]["position_weights"] == "dpace"
    with pytest.raises(ManifestMismatch, match='config.position_weights: run has "dpace", now "decay"'):
        train(**opts(store, tiny_qwen3, run, **{**kw, "position_weights": "decay", "max_steps": 6}, resume=True))


def test_a_dflash2_selector_miss_never_moves_a_position_weight(tiny_qwen3) -> None:
    """D-PACE's weights come from the block CE alone: a selector that misses differently (other codebooks) changes
    the selector's term, never a position's weight (NeMo-Automodel #2572's review)."""
    model, head, batch = dflash2_batch(tiny_qwen3, top_k=4, std=0.3)
    a = predict(model, batch, head.embed, head.lm_head, position_weights="dpace")
    with torch.no_grad():
        model.candidate_selector.successor_codebook.normal_(0.0, 5.0)
        model.candidate_selector.predecessor_codebook.normal_(0.0, 5.0)
    b = predict(model, batch, head.embed, head.lm_head, position_weights="dpace")
    assert a.selector["selector_correct"] != b.selector["selector_correct"] or \
        a.selector["selector_ce_sum"] != pytest.approx(b.selector["selector_ce_sum"])
    assert a.slot_weight == b.slot_weight and a.weight_sum == b.weight_sum
    assert a.ce_sum == pytest.approx(b.ce_sum)  # the block CE is the backbone's, untouched by the selector


def dflash2_batch(target, *, top_k: int, std: float, **shape):
    """Return (a float64 DFlash 2 drafter of block 5 with weights N(0, std), the target's head, a packed batch)."""
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter
    from dflash.facts import build_target_layer_ids

    cfg = DrafterConfig.from_target(target, target_layer_ids=build_target_layer_ids(8), mask_token_id=262,
                                    draft_layers=1, block_size=5, drafter="dflash2", selector_top_k=top_k,
                                    conv_group_size=16, **shape)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    head = load_target_head(target, dtype=torch.float64)
    batch = pack_batch(_sequences(cfg.hidden_size, cfg.vocab_size), block_size=5, mask_token_id=262, max_anchors=8,
                       seed=0)
    return model, head, batch
