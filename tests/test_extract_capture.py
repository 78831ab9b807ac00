"""The truncated runner's features equal the full model's output_hidden_states[i + 1]; batched equals one-by-one."""
from __future__ import annotations

import pytest
import torch

from dflash.targets.load import load_for_features
from dflash.targets.runner import TargetRunner, pad_batch
from test_extract_run import one_torch_thread  # noqa: F401

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals

LAYERS = [1, 3, 5]


def _full(path, dtype):
    return load_for_features(path, torch.device("cpu"), dtype)


@pytest.mark.parametrize("target", ["tiny_qwen3", "tiny_llama"])
def test_capture_equals_output_hidden_states_exactly_in_fp32(target, request):
    path = request.getfixturevalue(target)
    full = _full(path, torch.float32)
    runner = TargetRunner(_full(path, torch.float32), LAYERS)
    gen = torch.Generator().manual_seed(1)
    for n in (1, 9, 33):
        ids = torch.randint(0, 250, (1, n), generator=gen)
        with torch.no_grad():
            ref = full(input_ids=ids, output_hidden_states=True).hidden_states
        got = runner.hidden(ids)
        for i, h in zip(LAYERS, got):
            assert torch.equal(h, ref[i + 1]), f"layer {i} differs from output_hidden_states[{i + 1}] at length {n}"
        # A neighbouring index would be the classic off-by-one: it must not match.
        assert not torch.allclose(got[0], ref[LAYERS[0]])


@pytest.mark.parametrize("target", ["tiny_qwen3", "tiny_llama"])
def test_batched_equals_one_by_one(target, request):
    path = request.getfixturevalue(target)
    runner = TargetRunner(_full(path, torch.float32), LAYERS)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 250, (n,), generator=gen) for n in (17, 40, 3, 29)]
    ids, lens = pad_batch(seqs, pad_id=0)
    batched = runner.hidden(ids)
    for b, s in enumerate(seqs):
        alone = runner.hidden(s[None])
        for h_b, h_1 in zip(batched, alone):
            torch.testing.assert_close(h_b[b, : len(s)], h_1[0], rtol=1e-4, atol=1e-4)
    packed = runner.features(ids, lens)
    assert packed.dtype == torch.bfloat16 and packed.shape == (sum(lens), len(LAYERS), runner.hidden_size)
    first = torch.stack([h[0, : lens[0]] for h in batched], dim=1).to(torch.bfloat16)
    assert torch.equal(packed[: lens[0]], first)


def test_runner_drops_everything_after_the_last_captured_layer(tiny_qwen3):
    model = _full(tiny_qwen3, torch.bfloat16)
    runner = TargetRunner(model, [0, 2])
    assert len(runner.text.layers) == 3
    assert model.lm_head is None and isinstance(runner.text.norm, torch.nn.Identity)


def test_cuda_extraction_leaves_cudnn_attention_out_and_restores_the_choice():
    from dflash.targets.kernels import attention_backends

    flags = torch.backends.cuda
    before = (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled())
    # cuDNN's attention plans each new (batch, length) shape; extraction's batches rarely repeat one.
    with attention_backends(torch.device("cuda", 0)):
        assert not flags.cudnn_sdp_enabled()
        assert flags.flash_sdp_enabled() and flags.mem_efficient_sdp_enabled() and flags.math_sdp_enabled()
    assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled()) == before
    # Asked for (the benchmark's comparison), or off CUDA, the choice is torch's own.
    for device, cudnn in ((torch.device("cuda", 0), True), (torch.device("cpu"), False)):
        with attention_backends(device, cudnn):
            assert flags.cudnn_sdp_enabled() == before[0]
