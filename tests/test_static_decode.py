"""The static-cache decoder (the CUDA-graph path, run eagerly on the CPU) equals the dynamic loop: tokens, acceptance
counts and forwards, for both drafters, sliding drafter layers, stop tokens, length cuts and reuse across prompts."""
from __future__ import annotations

import pytest
import torch

from dflash.decode.drafting import drafter_proposer
from dflash.decode.speculative import greedy_decode, load_target, speculative_decode
from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter
from dflash.decode.static import StaticDecoder
from dflash.facts import build_target_layer_ids
from dflash.targets.static_kv import StaticTarget, fast_unsupported
from test_speculative import FIT_PROMPTS, PROMPTS, _fitted_drafter

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(tiny_qwen3)


@pytest.fixture(scope="module")
def layer_ids(target):
    return build_target_layer_ids(target.config.num_hidden_layers)


@pytest.fixture(scope="module")
def fitted(tiny_qwen3, target, layer_ids):
    answers = [greedy_decode(target, p, max_new_tokens=40).tokens for p in FIT_PROMPTS]
    return _fitted_drafter(tiny_qwen3, target, layer_ids, answers)


def _both(target, drafter, prompt, decoder, **kw):
    cfg = drafter.config
    dynamic = speculative_decode(target, drafter_proposer(drafter, target), prompt, block_size=cfg.block_size,
                                 layer_ids=cfg.target_layer_ids, **kw)
    return dynamic, decoder.speculative(prompt, **kw)


def test_static_speculative_and_greedy_equal_the_dynamic_loop(target, fitted):
    decoder = StaticDecoder(target, fitted, max_len=64, sync_every=3)  # one decoder serves every prompt
    seen_long_block = False
    for prompt in FIT_PROMPTS + PROMPTS:
        for n in (0, 1, 7, 40):
            dynamic, static = _both(target, fitted, prompt, decoder, max_new_tokens=n)
            assert (static.tokens, static.accepted, static.forwards) == \
                   (dynamic.tokens, dynamic.accepted, dynamic.forwards), (prompt, n)
            seen_long_block |= max(static.accepted, default=0) > 1
            plain = greedy_decode(target, prompt, max_new_tokens=n)
            fast = decoder.greedy(prompt, max_new_tokens=n)
            assert (fast.tokens, fast.forwards) == (plain.tokens, plain.forwards)
    assert seen_long_block  # the fitted drafter gets drafts accepted: acceptance counts are really compared


def test_a_stop_token_cuts_both_paths_where_the_dynamic_loop_cuts(target, fitted):
    decoder = StaticDecoder(target, fitted, max_len=64)
    answer = greedy_decode(target, FIT_PROMPTS[0], max_new_tokens=40).tokens
    for stop in (answer[0], answer[5], answer[17]):
        dynamic, static = _both(target, fitted, FIT_PROMPTS[0], decoder, max_new_tokens=40, stop_ids=[stop])
        assert (static.tokens, static.accepted) == (dynamic.tokens, dynamic.accepted)
        assert static.tokens[-1] == stop
        assert decoder.greedy(FIT_PROMPTS[0], max_new_tokens=40, stop_ids=[stop]).tokens == static.tokens


def random_drafter(folder, target, **extra) -> DFlashDrafter:
    """Return a 2-layer block-4 drafter for the target in folder with weights large enough to draft varied tokens."""
    ids = build_target_layer_ids(target.config.num_hidden_layers)
    cfg = DrafterConfig.from_target(folder, target_layer_ids=ids, mask_token_id=259, draft_layers=2, block_size=4,
                                    **extra)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return drafter


@pytest.mark.parametrize("kind", ["dflash2", "sliding"])
def test_dflash2_and_sliding_drafters_decode_as_the_dynamic_loop(tiny_llama, kind):
    target = load_target(tiny_llama)
    extra = dict(drafter="dflash2", selector_rank=8, selector_top_k=4) if kind == "dflash2" else \
        dict(sliding_window=3, full_every=2)
    drafter = random_drafter(tiny_llama, target, **extra)
    decoder = StaticDecoder(target, drafter, max_len=48)
    for prompt in PROMPTS:
        dynamic, static = _both(target, drafter, prompt, decoder, max_new_tokens=24)
        assert (static.tokens, static.accepted) == (dynamic.tokens, dynamic.accepted)


@pytest.mark.parametrize("cuda_arithmetic", [False, True])
def test_static_target_features_equal_the_hidden_states_transformers_reports(target, cuda_arithmetic):
    """cuda_arithmetic: the forms fp32 on CUDA takes (narrowing projections as batched one-row products, attention
    as matmul + softmax), run here on the CPU."""
    last = target.config.num_hidden_layers - 1
    static = StaticTarget(target, max_len=32, feature_layers=[1, 4, last])
    static.fp32_cuda = cuda_arithmetic
    ids = torch.tensor(PROMPTS[1])
    with torch.no_grad():
        h, feats = static.forward(ids, torch.zeros(1, dtype=torch.long), 16, features=True)
        hs = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats, torch.cat([hs[i + 1][0] for i in (1, 4, last)], -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h, hs[-1][0], rtol=1e-4, atol=1e-4)


def test_the_cuda_arithmetic_decodes_as_the_dynamic_loop(target, fitted):
    decoder = StaticDecoder(target, fitted, max_len=64)
    decoder.target.fp32_cuda = True
    for prompt in FIT_PROMPTS[:2] + PROMPTS[:2]:
        dynamic, static = _both(target, fitted, prompt, decoder, max_new_tokens=30)
        assert (static.tokens, static.accepted) == (dynamic.tokens, dynamic.accepted)


def test_rows_linear_is_the_linear_row_by_row():
    from dflash.targets.static_kv import rows_linear

    torch.manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(48, 16, bias=bias)
        h = torch.randn(1, 7, 48)
        torch.testing.assert_close(rows_linear(lin, h), lin(h), rtol=1e-6, atol=1e-6)
        assert torch.equal(rows_linear(lin, h)[0, 3], rows_linear(lin, h[:, 3:4])[0, 0])


def test_a_target_whose_rope_rescales_as_it_grows_is_left_to_the_dynamic_loop(target):
    """Dynamic RoPE compares lengths on the host and swaps its frequencies: no CUDA graph can hold that."""
    from transformers import Qwen3Config

    assert fast_unsupported(target.config) is None
    cfg = Qwen3Config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6})
    assert "dynamic" in fast_unsupported(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("drafter_kind", ["dflash", "dflash2"])
def test_cuda_graphs_decode_as_the_dynamic_loop_on_a_gpu(tiny_qwen3, drafter_kind):
    """On a GPU, fp32: the captured graphs (one replay per block) give the dynamic loop's tokens and acceptances."""
    target = load_target(tiny_qwen3, device="cuda")
    answers = [greedy_decode(target, p, max_new_tokens=40).tokens for p in FIT_PROMPTS]
    cpu_target = load_target(tiny_qwen3)
    ids = build_target_layer_ids(target.config.num_hidden_layers)
    drafter = _fitted_drafter(tiny_qwen3, cpu_target, ids, answers) if drafter_kind == "dflash" else \
        DFlashDrafter(DrafterConfig.from_target(tiny_qwen3, target_layer_ids=ids, mask_token_id=259, draft_layers=1,
                                                block_size=4, drafter="dflash2", selector_rank=8,
                                                selector_top_k=4)).eval()
    drafter = drafter.to("cuda")
    decoder = StaticDecoder(target, drafter, max_len=64)
    assert decoder.graphs
    for prompt in FIT_PROMPTS + PROMPTS:
        dynamic, static = _both(target, drafter, prompt, decoder, max_new_tokens=40)
        assert (static.tokens, static.accepted) == (dynamic.tokens, dynamic.accepted)
        assert decoder.greedy(prompt, max_new_tokens=40).tokens == greedy_decode(target, prompt,
                                                                                 max_new_tokens=40).tokens
