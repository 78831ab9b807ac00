"""The DFlash 2 drafter: causal block convolution, the selector's path and loss, export names, decoding, resume."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch.nn import functional as F

from test_speculative import compare_on_prompts
from test_train_run import opts, sigkill_and_resume, train

from dflash.errors import ConfigError, DflashError, InputError
from dflash.drafter.conv import GroupedDynamicCausalConv
from dflash.decode.speculative import load_target
from dflash.drafter.files import check_serving_tensors, save_drafter_files, serving_tensors, write_export
from dflash.drafter.linear_ce import candidate_logits, chunked_linear_ce, chunked_linear_ce_topk
from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter, unary_logits
from dflash.drafter.selector import CandidateSelector
from dflash.facts import build_target_layer_ids
from dflash.train.metrics import read_metrics
from dflash.train.selector_loss import SELECTOR_WEIGHT, selector_loss, training_candidates


def _config(**over) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=40, block_size=6, target_layer_ids=(1, 3),
                num_target_layers=6, mask_token_id=39, drafter="dflash2", conv_kernel_size=2, conv_group_size=8,
                selector_rank=4, selector_top_k=5)
    base.update(over)
    return DrafterConfig(**base)


def _randomize(model: torch.nn.Module, std: float = 0.3, seed: int = 0) -> torch.nn.Module:
    """Make every weight random (the identity/zero inits of DFlash 2's parts would hide their bugs)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return model


@pytest.mark.parametrize("kernel", [1, 2, 3])
def test_the_convolution_is_causal_along_each_block_and_blocks_never_mix(kernel) -> None:
    B, H = 6, 32
    conv = _randomize(GroupedDynamicCausalConv(H, kernel, 8, B).double())
    x = torch.randn(3 * B, H, dtype=torch.float64)
    out, taps = conv.prepare(x)
    both = conv.finish(out, taps)
    for t in range(3 * B):
        y = x.clone()
        y[t] += torch.randn(H, dtype=torch.float64)
        o2, t2 = conv.prepare(y)
        b2 = conv.finish(o2, t2)
        block, slot = divmod(t, B)
        reach = range(t, min(block * B + B, t + kernel))  # slots t .. t+k-1 of its own block, no further
        for r in range(3 * B):
            changed = not torch.equal(o2[r], out[r])
            assert changed == (r in reach), (t, r)
            assert torch.equal(b2[r], both[r]) or r in range(t, block * B + B)  # finish: within the block, later only
    # A fresh convolution is the identity: DFlash 2 starts as its DFlash backbone.
    fresh = GroupedDynamicCausalConv(H, kernel, 8, B).double()
    o, k = fresh.prepare(x)
    assert torch.equal(o, x) and torch.equal(fresh.finish(x, k), x)


def test_the_selector_path_equals_scores_computed_slot_by_slot() -> None:
    V, H, r, K, S = 12, 8, 4, 5, 6
    sel = _randomize(CandidateSelector(H, V, r, K).double(), std=1.0)
    g = torch.Generator().manual_seed(1)
    hidden, logits = torch.randn(S, H, generator=g, dtype=torch.float64), torch.randn(S, V, generator=g, dtype=torch.float64)
    anchor = 7
    P, Sx, W = (t.detach() for t in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight))
    want, prev = [], anchor
    for i in range(S):
        best, pick = None, None
        for c in sorted(range(V), key=lambda c: -float(logits[i, c]))[:K]:
            score = float(logits[i, c]) + sum(float(P[prev, j]) * float(W[j] @ hidden[i]) * float(Sx[c, j])
                                              for j in range(r))
            if best is None or score > best:
                best, pick = score, c
        want.append(pick)
        prev = pick
    got = sel.path(hidden, logits, anchor).tolist()
    assert got == want
    assert got != logits.argmax(-1).tolist()  # the pair term changed some pick: the test sees the selector
    # A fresh selector (successor codebook 0) picks the argmax.
    fresh = CandidateSelector(H, V, r, K).double()
    assert fresh.path(hidden, logits, anchor).tolist() == logits.argmax(-1).tolist()


def test_the_selector_loss_with_the_gold_token_inside_and_outside_the_top_k() -> None:
    cfg = _config(vocab_size=12, mask_token_id=11, selector_top_k=3, output_multiplier=0.5, final_logit_softcapping=4.0)
    sel = _randomize(CandidateSelector(cfg.hidden_size, 12, 4, 3).double(), std=0.5)
    g = torch.Generator().manual_seed(2)
    head = torch.randn(12, cfg.hidden_size, generator=g, dtype=torch.float64)
    hidden = torch.randn(2, cfg.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    raw = hidden @ head.T
    top = unary_logits(cfg, raw).topk(3, dim=-1).indices
    labels = torch.tensor([int(top[0, 1]), next(t for t in range(12) if t not in top[1].tolist())])  # inside, outside
    prev = torch.tensor([4, 9])
    scale = torch.tensor([0.75, 0.25], dtype=torch.float64)
    cand, target, covered = training_candidates(top, labels)
    assert covered.tolist() == [True, False] and target.tolist() == [1, 2]
    assert torch.equal(cand[0], top[0]) and cand[1].tolist() == top[1, :2].tolist() + [int(labels[1])]
    terms = selector_loss(sel, cfg, hidden, head, top, labels, prev, scale)
    # The same loss written out: K-way CE of unary + pair scores over the training candidates.
    want = 0.0
    for i in range(2):
        u = unary_logits(cfg, raw[i, cand[i]])
        pair = (sel.predecessor_codebook[prev[i]] * sel.hidden_projection(hidden[i]) * sel.successor_codebook[cand[i]]).sum(-1)
        want = want + scale[i] * F.cross_entropy((u + pair)[None], target[i:i + 1])
    torch.testing.assert_close(terms.loss, SELECTOR_WEIGHT * want)
    assert terms.covered.tolist() == [True, False] and not bool(terms.correct[1])  # a miss can never be picked
    g1 = torch.autograd.grad(terms.loss, hidden, retain_graph=True)[0]
    g2 = torch.autograd.grad(want, hidden)[0]
    torch.testing.assert_close(g1, g2)


def test_chunked_ce_with_logit_scales_and_candidate_logits_match_autograd() -> None:
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 8, generator=g, dtype=torch.float64)
    lab, scale = torch.randint(0, 20, (9,), generator=g), torch.rand(9, generator=g, dtype=torch.float64)
    loss, ce, _, top, _ = chunked_linear_ce_topk(h, w, lab, scale, 4, chunk_rows=4, multiplier=0.3, softcap=2.0)
    logits = torch.tanh(h @ w.T * 0.3 / 2.0) * 2.0
    ref = (F.cross_entropy(logits, lab, reduction="none") * scale).sum()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, h)[0], torch.autograd.grad(ref, h)[0])
    assert torch.equal(top, logits.topk(4, dim=-1).indices)
    plain = chunked_linear_ce(h, w, lab, scale, 4)[0]
    torch.testing.assert_close(plain, (F.cross_entropy(h @ w.T, lab, reduction="none") * scale).sum())
    ids = torch.randint(0, 20, (9, 3), generator=g)
    got = candidate_logits(h, w, ids, chunk_rows=2)
    want = (h[:, None, :] * w[ids]).sum(-1)
    torch.testing.assert_close(got, want)
    gw = torch.randn(9, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad((got * gw).sum(), h)[0], torch.autograd.grad((want * gw).sum(), h)[0])


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="--conv-group-size 7 must divide the hidden size 32"):
        _config(conv_group_size=7)
    with pytest.raises(ConfigError, match="--selector-top-k 41"):
        _config(selector_top_k=41)
    with pytest.raises(ConfigError, match="--conv-kernel-size"):
        _config(conv_kernel_size=7)
    from dflash.config import TrainConfig
    with pytest.raises(ConfigError, match="--drafter 'dflash3'"):
        TrainConfig(store="s", target="t", out="o", drafter="dflash3")


def test_export_names_shapes_and_config_follow_the_released_dflash2_pattern(tmp_path) -> None:
    cfg = _config(layer_types=("sliding_attention", "sliding_attention"), sliding_window=64, output_multiplier=0.25,
                  final_logit_softcapping=20.0)
    model = _randomize(DFlashDrafter(cfg))
    out = write_export(save_drafter_files(model, tmp_path / "ckpt"), tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    # The pattern of z-lab's DFlash 2 checkpoint header, for H 32, I 64, 2 heads of 16, 1 kv head, V 40, k 2, g 8, r 4.
    per_layer = {"attention_conv.base_kernel": (2, 2, 32), "attention_conv.kernel_projection.weight": (2 * 2 * 4, 32),
                 "mlp_conv.base_kernel": (2, 2, 32), "mlp_conv.kernel_projection.weight": (16, 32),
                 "input_layernorm.weight": (32,), "post_attention_layernorm.weight": (32,),
                 "mlp.down_proj.weight": (32, 64), "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32),
                 "self_attn.k_norm.weight": (16,), "self_attn.q_norm.weight": (16,), "self_attn.k_proj.weight": (16, 32),
                 "self_attn.v_proj.weight": (16, 32), "self_attn.q_proj.weight": (32, 32),
                 "self_attn.o_proj.weight": (32, 32)}
    want = {f"layers.{i}.{k}": v for i in range(2) for k, v in per_layer.items()}
    want.update({"candidate_selector.hidden_projection.weight": (4, 32), "candidate_selector.predecessor_codebook": (40, 4),
                 "candidate_selector.successor_codebook": (40, 4), "fc.weight": (32, 64), "hidden_norm.weight": (32,),
                 "norm.weight": (32,)})
    assert shapes == want == serving_tensors(cfg)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"] == {"block_size": 6, "conv_group_size": 8, "conv_kernel_size": 2,
                                       "final_logit_softcapping": 20.0, "mask_token_id": 39, "output_multiplier": 0.25,
                                       "selector_rank": 4, "selector_top_k": 5, "target_layer_ids": [1, 3]}
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 64
    assert config["use_sliding_window"] is True and config["num_target_layers"] == 6
    # The export round-trips, and a folder an engine would load partly is refused before anything is written.
    from dflash.drafter.files import load_drafter
    back = load_drafter(out, dtype=torch.float32)
    assert back.config == cfg
    sd = {k: v for k, v in model.state_dict().items()}
    renamed = dict(sd)
    renamed["candidate_selector.predecessor_codebook.weight"] = renamed.pop("candidate_selector.predecessor_codebook")
    with pytest.raises(DflashError, match=r"missing \['candidate_selector.predecessor_codebook'\].*unknown"):
        check_serving_tensors(renamed, cfg, "--out x")
    one = _config(drafter="dflash")
    with pytest.raises(DflashError, match="DFlashDraftModel.*unknown"):
        check_serving_tensors(sd, one, "--out x")
    with pytest.raises(InputError, match="--remote-code"):
        write_export(tmp_path / "ckpt", tmp_path / "rc", remote_code=True)


def test_greedy_speculative_decoding_with_a_dflash2_drafter_is_greedy(tiny_qwen3) -> None:
    target = load_target(tiny_qwen3)
    ids = build_target_layer_ids(target.config.num_hidden_layers)
    cfg = DrafterConfig.from_target(tiny_qwen3, target_layer_ids=ids, mask_token_id=259, draft_layers=1, block_size=4,
                                    drafter="dflash2", selector_rank=8, selector_top_k=4)
    drafter = _randomize(DFlashDrafter(cfg).eval(), std=0.3)
    prompts = [[5, 17, 99, 3], [200, 1, 42, 42, 7, 8, 250, 11, 60]]
    summary = compare_on_prompts(target, drafter, prompts, max_new_tokens=24)
    assert summary["identical"] and summary["identical_prompts"] == 2


def test_a_dflash2_run_logs_its_terms_refuses_another_drafter_and_resumes_after_sigkill(store, tiny_qwen3, tmp_path):
    kw = dict(epochs=1, batch_tokens=256, save_every=2, keep=3, drafter="dflash2", selector_rank=8, selector_top_k=4,
              block_size=4)
    full = sigkill_and_resume(store, tiny_qwen3, tmp_path, kw)
    steps = [r for r in read_metrics(full) if r.get("split") == "train"]
    for key in ("loss_block", "loss_selector", "selector_acc", "selector_tau_hat", "topk_recall"):
        assert key in steps[0], key
    assert json.loads((full / "config.json").read_text())["resolved"]["drafter"]["drafter"] == "dflash2"
    from dflash.errors import ManifestMismatch
    with pytest.raises(ManifestMismatch, match='config.drafter: run has "dflash2", now "dflash"'):
        train(**opts(store, tiny_qwen3, full, resume=True, **{**kw, "drafter": "dflash"}))


@pytest.mark.gpu
@pytest.mark.parametrize("drafter, weights", [("dflash", "dpace"), ("dflash2", "decay"), ("dflash2", "dpace")])
def test_the_new_drafter_and_weights_train_on_cuda_with_flex(store, tiny_qwen3, tmp_path, drafter, weights) -> None:
    """On a GPU: flex attention, the compiled layers and bf16, as the demo trains; the loss falls."""
    run = tmp_path / "run"
    train(**opts(store, tiny_qwen3, run, gpus="0", dtype="bfloat16", epochs=3, drafter=drafter,
                 position_weights=weights, selector_top_k=4, conv_group_size=16))
    steps = [r for r in read_metrics(run) if r.get("split") == "train"]
    assert steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["peak_mem_gib"] > 0
    if drafter == "dflash2":
        assert steps[-1]["loss_selector"] >= 0 and steps[-1]["selector_tau_hat"] >= 1.0
