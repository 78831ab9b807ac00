"""targets/flops.py's count of the target's forward against torch's FlopCounterMode and the model's own attention
masks on tiny targets, and extract/perf.py's MFU figures."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash.extract.perf import perf_line, worker_perf
from dflash.targets.adapter import layer_kinds, text_config, text_model, unequal_head_dims
from dflash.targets.flops import forward_flops, visible_pairs
from dflash.targets.kernels import Kernels
from dflash.tests.tiny_targets import TINY_WINDOW
from test_flops import matmul_flops
from test_targets import tiny_target  # noqa: F401

LENGTHS = [40, 23]


def _model(path, attention: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).eval()
    if any(hasattr(m, "is_concatenated") for m in model.modules()):
        model.set_experts_implementation("eager")  # one matmul per expert on its routed tokens: counted exactly
    return model


def _rows(vocab: int = 200) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    return ids, LENGTHS


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3", "mistral", "gpt_oss"])
def test_projections_experts_and_routers_equal_the_flop_counter(arch, tiny_target):  # noqa: F811
    """Every matmul outside attention, one row at a time (no padding): projections, MLA's low-rank ones, routers,
    shared experts and the top-k routed experts (not all of them)."""
    model = _model(tiny_target(arch), "eager" if arch == "gpt_oss" else "sdpa")
    text = text_model(model)
    cfg = text_config(text.config)
    flops = forward_flops(text, layer_kinds(cfg), cfg)
    ids, lengths = _rows()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        for b, n in enumerate(lengths):
            text(input_ids=ids[b: b + 1, :n], use_cache=False)
    counted = matmul_flops(counter)
    # The rotary embedding's frequencies: a matmul on transformers 5.17 (inv_freq x positions), none on 5.25;
    # not the model's FLOPs a token either way.
    counted -= sum(n for module, ops in counter.get_flop_counts().items() if module.endswith("rotary_emb")
                   for op, n in ops.items() if "mm" in str(op) or "matmul" in str(op))
    parts = flops.of_lengths(lengths)
    # eager attention multiplies every (query, key) pair, masked or not: its two bmm; so does SDPA's math kernel, what
    # the CPU runs for MLA's unequal query-key and value head dims (the tiny deepseek_v3's 24 and 16)
    if arch == "gpt_oss" or unequal_head_dims(cfg):
        per_pair = [p for p, _ in flops.attention]
        counted -= sum(per_pair) * sum(n * n for n in lengths)
    assert counted == pytest.approx(parts["projections"] + parts.get("experts", 0.0), rel=1e-9)
    assert ("experts" in parts) == (arch in ("qwen3_moe", "deepseek_v3", "gpt_oss"))


@pytest.mark.parametrize("arch", ["mistral", "gpt_oss", "gemma3_text", "qwen3"])
def test_attention_counts_the_pairs_the_models_own_masks_let_through(arch, tiny_target):  # noqa: F811
    model = _model(tiny_target(arch), "eager")
    text = text_model(model)
    cfg = text_config(text.config)
    flops = forward_flops(text, layer_kinds(cfg), cfg)
    ids, lengths = _rows()
    seen = []
    for b, n in enumerate(lengths):
        with torch.no_grad():
            out = text(input_ids=ids[b: b + 1, :n], use_cache=False, output_attentions=True)
        # A probability above zero is a pair the layer's mask let through (gpt-oss drops its sinks' column).
        seen.append([int((a[0] > 0).sum()) // a.shape[1] for a in out.attentions])
    per_layer = [sum(row[j] for row in seen) for j in range(len(flops.attention))]
    want = [sum(visible_pairs(n, w) for n in lengths) for _, w in flops.attention]
    assert per_layer == want
    want_windows = {"mistral": {TINY_WINDOW}, "gpt_oss": {0, TINY_WINDOW}, "gemma3_text": {0, TINY_WINDOW},
                    "qwen3": {0}}[arch]
    assert {w for _, w in flops.attention} == want_windows
    assert max(lengths) > 3 * TINY_WINDOW  # rows long enough for the windows to hide keys


def test_visible_pairs_of_a_window() -> None:
    assert visible_pairs(5) == 15 and visible_pairs(5, 8) == 15
    assert visible_pairs(10, 3) == 1 + 2 + 3 * 8 == visible_pairs(10, 3)
    assert visible_pairs(10, 1) == 10


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_linear_attention_layers_count_their_state_not_pairs(arch, tiny_target):  # noqa: F811
    model = _model(tiny_target(arch), "sdpa")
    text = text_model(model)
    cfg = text_config(text.config)
    kinds = layer_kinds(cfg)
    flops = forward_flops(text, kinds, cfg)
    assert len(flops.attention) == kinds.count("full_attention") and "linear_attention" in kinds
    per_layer = 3 * 2 * cfg.linear_key_head_dim * cfg.linear_value_head_dim * cfg.linear_num_value_heads
    assert flops.per_token["linear_attention"] == kinds.count("linear_attention") * per_layer


class _Runner:
    kernels = Kernels("flex_attention", "grouped_mm")


def test_mfu_is_the_rate_over_the_devices_peak_and_no_number_where_it_is_unknown() -> None:
    from dflash.drafter.flops import peak_flops

    peak = peak_flops("NVIDIA H200")
    p = worker_perf(_Runner(), "NVIDIA H200", peak, flops=4.0e15, tokens=200_000, steady_s=10.0, forward_device_s=8.0)
    assert p["flops_per_token"] == 20_000_000_000 and p["tflops_per_s"] == 400.0
    assert p["mfu"] == round(400e12 / peak, 4) and p["forward_mfu"] == round(500e12 / peak, 4)
    line = perf_line(p)
    assert "attention flex_attention, experts grouped_mm" in line and "20.0 GFLOP a token" in line
    assert f"MFU {100 * 400e12 / peak:.1f}% of NVIDIA H200's 989.5 TFLOP/s dense bf16" in line
    cpu = worker_perf(_Runner(), "the CPU", None, flops=4.0e9, tokens=1000, steady_s=2.0)
    assert cpu["mfu"] is None and "no MFU: the bf16 peak of the CPU is not known" in perf_line(cpu)
    assert peak_flops("Some Future GPU") is None


def test_the_runs_device_memory_is_in_the_perf_line_and_its_allocator_retries_name_the_fix() -> None:
    from dflash.extract.perf import device_memory, memory_mark

    assert memory_mark("cpu") is None and device_memory("cpu", None) is None  # no counters off CUDA, no line
    calm = {"peak_allocated_gib": 60.1, "peak_reserved_gib": 70.4, "total_gib": 79.2, "alloc_retries": 0,
            "device_alloc": 12, "device_free": 0, "ooms": 0}
    p = worker_perf(_Runner(), "NVIDIA H100 80GB HBM3", 989.5e12, flops=4.0e15, tokens=200_000, steady_s=10.0,
                    memory=calm)
    assert p["device_memory"] == calm
    line = perf_line(p)
    assert line.endswith("; device memory peak 70.4 of 79.2 GiB") and "flushed" not in line
    tight = perf_line(worker_perf(_Runner(), "NVIDIA H100 80GB HBM3", 989.5e12, flops=4.0e15, tokens=200_000,
                                  steady_s=10.0, memory={**calm, "alloc_retries": 1234}))
    assert "the allocator flushed its cache 1,234 times" in tight and "--batch-tokens" in tight
    assert "expandable_segments:True" in tight
    assert "device memory" not in perf_line(worker_perf(_Runner(), "the CPU", None, flops=4.0e9, tokens=1000,
                                                        steady_s=2.0))
