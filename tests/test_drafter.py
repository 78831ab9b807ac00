"""The drafter: config from a target, target head reading, eager float64 reference, batch == inference, flex."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from dflash.errors import InputError
from dflash.facts import build_target_layer_ids
from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter, draft_logits
from dflash.train.objective import drafter_loss
from dflash.train.packing import pack_batch
from dflash.drafter.attention import make_attend
from dflash.targets.head import load_target_head


def _drafter(target, *, B: int = 5, sliding: int | None = None, dtype=torch.float64, seed: int = 0):
    cfg = DrafterConfig.from_target(
        target, target_layer_ids=build_target_layer_ids(8), mask_token_id=259 + 3, draft_layers=2, block_size=B,
        sliding_window=sliding, full_every=2 if sliding else None,
    )
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    model.reset_parameters(std=0.2)  # larger than the default so layers visibly matter in small tests
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # non-trivial norm weights, so a missing or misplaced norm shows
    return model.to(dtype)


def _sequences(H: int, vocab: int, lengths=(23, 9, 17), dtype=torch.float64, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in lengths:
        out.append(dict(
            input_ids=torch.randint(0, vocab - 20, (T,), generator=g),
            loss_mask=torch.rand(T, generator=g) > 0.25,
            features=torch.randn(T, 5, H, generator=g).to(dtype),
        ))
    return out


def _eager_block(model: DFlashDrafter, feats: torch.Tensor, anchor: int, anchor_id: int, embed, head) -> torch.Tensor:
    """Float64 logits [B-1, V] of one block, written from the DFlash description without the drafter's code."""
    cfg = model.config
    p = {k: v.double() for k, v in model.state_dict().items()}
    d, nh, nkv, B, eps = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.block_size, cfg.rms_norm_eps

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    inv = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rope(x, pos):  # x [n, heads, d]
        ang = pos.double()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    ctx = rms(feats[:anchor].reshape(anchor, -1).double() @ p["fc.weight"].T, p["hidden_norm.weight"])
    x = embed.double()[torch.tensor([anchor_id] + [cfg.mask_token_id] * (B - 1))]
    pos_c, pos_b = torch.arange(anchor), anchor + torch.arange(B)
    for i, kind in enumerate(cfg.layer_types):
        L = lambda n: p[f"layers.{i}.{n}.weight"]  # noqa: E731
        h = rms(x, L("input_layernorm"))
        q = rope(rms((h @ L("self_attn.q_proj").T).view(B, nh, d), L("self_attn.q_norm")), pos_b)
        kc = rope(rms((ctx @ L("self_attn.k_proj").T).view(-1, nkv, d), L("self_attn.k_norm")), pos_c)
        kb = rope(rms((h @ L("self_attn.k_proj").T).view(B, nkv, d), L("self_attn.k_norm")), pos_b)
        k = torch.cat([kc, kb])
        v = torch.cat([ctx @ L("self_attn.v_proj").T, h @ L("self_attn.v_proj").T]).view(-1, nkv, d)
        key_pos = torch.cat([pos_c, pos_b])
        outs = []
        for head_i in range(nh):
            g = head_i // (nh // nkv)
            s = q[:, head_i] @ k[:, g].T / math.sqrt(d)
            if kind == "sliding_attention":
                s = s.masked_fill((pos_b[:, None] - key_pos[None]).abs() >= cfg.sliding_window, -math.inf)
            outs.append(torch.softmax(s, -1) @ v[:, g])
        x = x + torch.cat(outs, -1) @ L("self_attn.o_proj").T
        h = rms(x, L("post_attention_layernorm"))
        x = x + (F.silu(h @ L("mlp.gate_proj").T) * (h @ L("mlp.up_proj").T)) @ L("mlp.down_proj").T
    return rms(x, p["norm.weight"])[1:] @ head.double().T


def _batch_logits(model, batch, embed, head, attention="sdpa", capacity=None) -> torch.Tensor:
    """Logits [A, B-1, V] of every block of a packed batch, through the training forward."""
    emb = F.embedding(batch.block_ids.reshape(-1), embed.to(model.fc.weight.dtype))
    hidden = model(batch.features, batch.ctx_pos, emb, batch.block_pos.reshape(-1),
                   make_attend(batch, model.config, attention, capacity))
    hidden = hidden.view(batch.num_blocks, batch.block_size, -1)[:, 1:]
    return (hidden @ head.to(hidden.dtype).T).float()


def test_config_is_derived_from_the_target(tiny_qwen3) -> None:
    cfg = DrafterConfig.from_target(tiny_qwen3, target_layer_ids=[1, 2, 3, 4, 5], mask_token_id=262,
                                    draft_layers=3, block_size=10, sliding_window=8, full_every=3)
    target = json.loads((tiny_qwen3 / "config.json").read_text())
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"], target["head_dim"])
    assert cfg.rope_parameters["rope_theta"] == 1e6 and cfg.rms_norm_eps == target["rms_norm_eps"]
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert cfg.num_target_layers == 8 and cfg.block_size == 10 and cfg.sliding_window == 8
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("tied", [False, True])
def test_target_head_reads_only_the_two_tensors(tmp_path, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    from dflash.tests.tiny_targets import build_tiny_target

    path = build_tiny_target(tmp_path / "t", "qwen3", num_layers=2, tie_word_embeddings=tied)
    head = load_target_head(path)
    ref = AutoModelForCausalLM.from_pretrained(path)
    assert head.tied == tied
    assert torch.equal(head.embed, ref.get_input_embeddings().weight)
    assert torch.equal(head.lm_head, ref.get_output_embeddings().weight)


def test_target_head_names_a_folder_without_weights(tmp_path) -> None:
    with pytest.raises(InputError, match="model.safetensors"):
        load_target_head(tmp_path)


@pytest.mark.parametrize("sliding", [None, 6])
def test_sdpa_batch_equals_eager_float64_reference(tiny_qwen3, sliding: int | None) -> None:
    model = _drafter(tiny_qwen3, sliding=sliding)
    head = load_target_head(tiny_qwen3, dtype=torch.float64)
    seqs = _sequences(model.config.hidden_size, model.config.vocab_size)
    batch = pack_batch(seqs, block_size=5, mask_token_id=model.config.mask_token_id, max_anchors=4, seed=1)
    got = _batch_logits(model, batch, head.embed, head.lm_head).double()
    for i in range(batch.num_blocks):
        s, a = int(batch.block_seq[i]), int(batch.anchor_pos[i])
        want = _eager_block(model, seqs[s]["features"], a, int(batch.block_ids[i, 0]), head.embed, head.lm_head)
        # RoPE angles are formed in fp32 (as transformers does), so agreement is to fp32 resolution.
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize("sliding", [None, 4])
def test_block_in_training_batch_equals_block_alone(tiny_qwen3, dtype, tol, sliding) -> None:
    model = _drafter(tiny_qwen3, sliding=sliding, dtype=dtype)
    head = load_target_head(tiny_qwen3, dtype=dtype)
    seqs = _sequences(model.config.hidden_size, model.config.vocab_size, lengths=(31, 6, 19, 12), dtype=dtype)
    batch = pack_batch(seqs, block_size=5, mask_token_id=model.config.mask_token_id, max_anchors=6, seed=2)
    assert len(set(batch.block_seq.tolist())) >= 3  # several packed sequences contribute blocks
    in_batch = _batch_logits(model, batch, head.embed, head.lm_head)
    for i in range(batch.num_blocks):
        s, a = int(batch.block_seq[i]), int(batch.anchor_pos[i])
        alone = draft_logits(model, seqs[s]["features"], int(batch.block_ids[i, 0]), head.embed, head.lm_head,
                             anchor_pos=a)
        torch.testing.assert_close(in_batch[i], alone.float(), rtol=tol, atol=tol)
        if dtype == torch.float32:  # the greedy drafts must agree exactly where the numbers are this close
            assert torch.equal(in_batch[i].argmax(-1), alone.argmax(-1))


def test_loss_trains_every_parameter_and_bf16_tracks_fp32(tiny_qwen3) -> None:
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _drafter(tiny_qwen3, dtype=dtype)
        head = load_target_head(tiny_qwen3, dtype=dtype)
        seqs = _sequences(model.config.hidden_size, model.config.vocab_size, dtype=dtype)
        batch = pack_batch(seqs, block_size=5, mask_token_id=model.config.mask_token_id, max_anchors=8, seed=0)
        loss, metrics = drafter_loss(model, batch, head.embed, head.lm_head, chunk_rows=7)
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing
        assert metrics.loss == pytest.approx(float(loss.detach()), rel=1e-2)
        assert 1.0 <= metrics.tau_hat <= 5.0 and metrics.blocks == batch.num_blocks
        losses[dtype] = float(loss.detach())
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], rel=0.03)


def test_a_few_steps_reduce_the_loss(tiny_qwen3) -> None:
    model = _drafter(tiny_qwen3, dtype=torch.float32)
    model.reset_parameters()
    head = load_target_head(tiny_qwen3)
    seqs = _sequences(model.config.hidden_size, model.config.vocab_size, dtype=torch.float32)
    batch = pack_batch(seqs, block_size=5, mask_token_id=model.config.mask_token_id, max_anchors=8, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        loss, _ = drafter_loss(model, batch, head.embed, head.lm_head)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss)
    assert float(loss) < 0.8 * first


@pytest.mark.slow
def test_flex_forward_equals_sdpa_on_cpu(tiny_qwen3) -> None:
    # flex has no CPU backward, but its forward checks the block mask, the bucketing and the padding: to size
    # buckets, to a fixed capacity well above the batch (the run's one shape), and a batch over the capacity.
    # Sizes chosen so that every case pads to the same shape (256 context + 256 block rows): flex compiles once
    # per mask kind instead of once per shape (each new shape costs ~25 s of inductor on a 2-core CPU).
    model = _drafter(tiny_qwen3, sliding=4, dtype=torch.float32)
    head = load_target_head(tiny_qwen3)
    big, small = (
        pack_batch(_sequences(model.config.hidden_size, model.config.vocab_size, lengths=lengths, dtype=torch.float32),
                   block_size=5, mask_token_id=model.config.mask_token_id, max_anchors=anchors, seed=0)
        for lengths, anchors in (((130, 40, 90), 17), ((60, 30), 20)))
    capacity, under = (256, 51), (100, 10)
    assert big.ctx_pos.shape[0] > under[0] and big.num_blocks > under[1]  # over `under`: back to size buckets
    assert 2 * small.ctx_pos.shape[0] < capacity[0] and small.num_blocks < capacity[1]  # well below capacity
    with torch.no_grad():
        for batch, capacities in ((big, (None, capacity, under)), (small, (capacity,))):
            a = _batch_logits(model, batch, head.embed, head.lm_head, "sdpa")
            for cap in capacities:
                b = _batch_logits(model, batch, head.embed, head.lm_head, "flex", cap)
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_flex_equals_sdpa_on_cuda(tiny_qwen3) -> None:
    dev = torch.device("cuda")
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 0.1)):
        model = _drafter(tiny_qwen3, sliding=4, dtype=dtype).to(dev)
        head = load_target_head(tiny_qwen3, dtype=dtype, device=dev)
        seqs = _sequences(model.config.hidden_size, model.config.vocab_size, lengths=(300, 77, 190), dtype=dtype)
        seqs = [{k: v.to(dev) for k, v in s.items()} for s in seqs]
        batch = pack_batch(seqs, block_size=5, mask_token_id=model.config.mask_token_id, max_anchors=40, seed=0)
        a = _batch_logits(model, batch, head.embed, head.lm_head, "sdpa")
        for capacity in (None, (1500, 300)):  # size buckets, and the fixed shape of a run (well above the batch)
            b = _batch_logits(model, batch, head.embed, head.lm_head, "flex", capacity)
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        grads = {}
        for kind, capacity in (("sdpa", None), ("flex", None), ("flex", (1500, 300))):
            model.zero_grad()
            loss, _ = drafter_loss(model, batch, head.embed, head.lm_head, attention=kind, capacity=capacity)
            loss.backward()
            grads[kind, capacity] = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        ref = grads["sdpa", None]
        for key in (("flex", None), ("flex", (1500, 300))):
            rel = (ref - grads[key]).norm() / ref.norm()
            assert float(rel) < 2e-2, key  # the backward too: forward agreement alone has hidden flex dK/dV bugs
