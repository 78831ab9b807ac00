"""The scaled codecs on the device that makes or consumes the features (storage/device_codec.py) are the store's numpy
codecs bit for bit, and a trainer that decodes the stored codes on its device trains on the very batches the store's
read pool would have decoded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash.storage import Store, codec
from dflash.storage.device_codec import decode_on_device, encode_on_device


def hostile_features(seed: int = 0) -> np.ndarray:
    """Return float32 features [70, 3, 577] whose rows span 10^-13..10^13, with a zero row, NaN, +-inf, values near
    float32's and bf16's largest, subnormals and a row of massive activations."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((70, 3, 577)).astype(np.float32)
    x *= np.exp(rng.uniform(-30, 30, (70, 3, 1))).astype(np.float32)
    x[0, 0] = 0
    x[1, 1, 5] = np.nan
    x[2, 2, 3] = np.inf
    x[5, 2, 7] = -np.inf
    x[3, 0, :5] = 1e38
    x[6, 0, 0] = 3e38
    x[4, 1] = 1e-40
    x[7, 2, :3] = 2e4 * np.abs(x[7, 2]).max()  # a few channels 20,000x the row: past uq6's 32,767 steps
    return x


def bits_of(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def nan_bits(b: np.ndarray) -> np.ndarray:
    return ((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)


def check_against_numpy(device: str) -> None:
    """Each scaled codec on `device` against the numpy codec on the same bf16 bits: the device's own rounding of the
    float32 features (the CPU rounds a NaN to 0xFFFF, CUDA to 0x7FFF: an H200 showed it, 2026-12-05; in extraction
    the features are bf16 on the GPU already). Every codec is checked before any failure is reported."""
    x = torch.from_numpy(hostile_features())
    on_device = x.to(device).to(torch.bfloat16)
    bits = bits_of(on_device.cpu())
    failed = []
    for name in codec.SCALED_CODECS:
        q, scales = codec.encode_scaled(bits, name)
        dq, dscales = encode_on_device(x.to(device), name)
        got = dq.cpu().numpy().view(q.dtype)
        if not np.array_equal(got, q):
            failed.append((name, "codes", np.argwhere(got != q)[:5].tolist()))
        if not np.array_equal(dscales.cpu().numpy(), scales, equal_nan=True):
            failed.append((name, "scales"))
        # float32 features are rounded to bf16 first, as the writer stores them
        if not np.array_equal(encode_on_device(on_device, name)[0].cpu().numpy().view(q.dtype), q):
            failed.append((name, "codes of bf16 features"))
        want = np.empty_like(bits)
        codec.decode_scaled_into(name, q, scales, want)
        back = bits_of(decode_on_device(dq, dscales, name).cpu())
        same = (back == want) | (nan_bits(back) & nan_bits(want))  # NaN stays NaN; its bits may differ
        if not same.all():
            failed.append((name, "decoded", np.argwhere(~same)[:5].tolist()))
        assert nan_bits(want).any() and not np.array_equal(back, bits), name  # the rows above reached NaN; lossy
    assert not failed, failed
    with pytest.raises(ValueError, match="not one of the scaled codecs"):
        decode_on_device(dq, dscales, "blosc")


@pytest.mark.internals  # torch's conversions and division: run on every new torch release (DFLASH_CI=newest)
def test_the_device_codecs_are_the_stores_numpy_codecs_bit_for_bit_on_the_cpu():
    check_against_numpy("cpu")


class NoDivisionByNumbers(torch.overrides.TorchFunctionMode):
    """Fails a division of a tensor by a Python number: on CUDA torch computes it as a product with the number's
    float32 reciprocal, up to an ulp off the CPU's quotient (ATen's BinaryDivTrueKernel.cu)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        names = ("__truediv__", "__itruediv__", "div", "div_", "true_divide")
        if getattr(func, "__name__", "") in names and len(args) > 1 and isinstance(args[1], (int, float)):
            raise AssertionError(f"{func.__name__} by the number {args[1]}: not correctly rounded on CUDA")
        return func(*args, **kwargs)


@pytest.mark.internals
def test_the_device_codecs_divide_only_by_tensors_which_cuda_divides_exactly():
    x = torch.from_numpy(hostile_features())[:8]
    with NoDivisionByNumbers():
        with pytest.raises(AssertionError, match="by the number 448"):  # the guard sees what it guards against
            x / 448.0
        for name in codec.SCALED_CODECS:
            q, s = encode_on_device(x, name)
            decode_on_device(q, s, name)


@pytest.mark.gpu
def test_the_device_codecs_are_the_stores_numpy_codecs_bit_for_bit_on_cuda():
    check_against_numpy("cuda")


def test_a_shard_read_as_stored_codes_decodes_on_the_device_to_the_read_pools_features(store):
    st = Store.open(store)
    assert st.header["codec"] in codec.SCALED_CODECS  # the default codec (uq6)
    for sid in st.committed_ids()[:2]:
        plain = st.read_shard(sid)
        n = plain.features.numel()
        raw = st.read_shard(sid, raw=True, out=torch.empty(n + 5, dtype=torch.bfloat16))
        assert plain.scales is None and raw.scales is not None and raw.codec == st.header["codec"]
        assert raw.features.dtype == torch.int16 and raw.scales.shape == plain.features.shape[:2]
        for i in range(plain.num_samples):
            got = decode_on_device(raw.sample(i)[2], raw.sample_scales(i), raw.codec)
            assert torch.equal(got.view(torch.int16), plain.sample(i)[2].view(torch.int16)), (sid, i)


def test_training_batches_decoded_on_the_device_are_the_read_pools_batches(store):
    """A CUDA trainer copies the stored codes and decodes them on its device (StreamSpec.device_decode): forced here
    on the CPU, every micro-batch of an epoch equals the one built from the read pool's decoding."""
    from test_train_readahead import batches_equal

    from dflash.train.packing import max_blocks_for
    from dflash.train.plan import ShardLengths, plan_round
    from dflash.train.stream import RoundStream, StreamSpec

    st = Store.open(store)
    ids = st.committed_ids()
    plan = plan_round(ShardLengths(st, False).load(ids), ids, num_slots=2, seed=0, epoch=0, round_index=0,
                      batch_tokens=256, buffer_tokens=1024)
    got = {}
    for device_decode in (False, True):
        spec = StreamSpec(slots=[0, 1], seed=0, block_size=8, mask_token_id=st.header["mask_token_id"], anchors=32,
                          max_blocks=max_blocks_for(256), device=torch.device("cpu"), depth=1,
                          device_decode=device_decode)
        stream = RoundStream(st, plan, spec, epoch=0, step_offset=0, start=0)
        try:
            got[device_decode] = list(stream)
            assert stream.prefetch.raw is device_decode
        finally:
            stream.close()
    assert len(got[True]) == plan.steps >= 3
    for a, b in zip(got[False], got[True]):
        assert a.tokens == b.tokens and len(a.micro) == len(b.micro) == 2
        assert all(batches_equal(x, y) for x, y in zip(a.micro, b.micro))
