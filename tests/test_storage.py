"""Store round trips on real zarr stores: bit-exact bf16, codecs, zarr compatibility, headers, claims, follow, gc."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.errors import ClaimLost, ConfigError, CorruptShard, ManifestMismatch, StoreError
from dflash.storage import Store
from dflash.storage import claims
from dflash.storage import fs as fs_module
from dflash.storage.fs import writer_tag
from dflash.storage.follow import follow_commits
from dflash.tests.synthetic_shards import activation_bits, read_sample, synthetic_sample, write_synthetic_shard

L, H = 3, 32


def header(codec: str = "blosc", num_shards: int = 4, **extra) -> dict:
    return {"layer_ids": [1, 4, 7][:L], "hidden_size": H, "codec": codec, "shard_plan": {"num_shards": num_shards},
            "target": {"path": "tiny", "config_hash": "abc"}, **extra}


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


# Every special bf16 pattern: +-0, +-inf, quiet and signalling NaNs with payloads, smallest/largest subnormals.
SPECIALS = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x007F, 0x7F7F],
                    np.uint16)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 45), min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
    codec=st.sampled_from(["blosc", "none"]),
    as_tensor=st.booleans(),
)
def test_bf16_round_trip_is_bit_exact(lengths, seed, codec, as_tensor):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        # 16-token chunks so samples straddle chunk boundaries and the last chunk is padded.
        store = Store.create_or_open(tmp, header(codec), chunk_tokens=16)
        written = []
        with store.try_claim(2) as w:
            for i, t in enumerate(lengths):
                bits = rng.integers(0, 1 << 16, size=(t, L, H), dtype=np.uint16)
                bits.reshape(-1)[: len(SPECIALS)] = SPECIALS[: bits.size]
                ids = rng.integers(0, 1 << 31, size=t)
                mask = rng.random(t) < 0.5
                feats = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16) if as_tensor else bits
                w.append(torch.from_numpy(ids) if as_tensor else ids, mask, feats, sample_id=100 + i)
                written.append((ids, mask, bits.copy()))
            rec = w.commit()
        assert rec["num_tokens"] == sum(lengths) and rec["num_samples"] == len(lengths)
        data = Store.open(tmp).read_shard(2)
        assert data.features.dtype == torch.bfloat16 and data.input_ids.dtype == np.int32
        assert list(data.sample_ids) == [100 + i for i in range(len(lengths))]
        for i, (ids, mask, bits) in enumerate(written):
            got_ids, got_mask, got_feats = data.sample(i)
            np.testing.assert_array_equal(got_ids, ids)
            np.testing.assert_array_equal(got_mask, mask)
            np.testing.assert_array_equal(bits_of(got_feats), bits)
            one = read_sample(store, 2, i)
            np.testing.assert_array_equal(one[2], bits)
            np.testing.assert_array_equal(one[0], ids)


@pytest.mark.parametrize("codec", ["blosc", "none", "fp8", "uq6", "bf16m2", "bf16m1"])
def test_zarr_reads_what_we_wrote(tmp_path, codec):
    import zarr

    store = Store.create_or_open(str(tmp_path), header(codec), chunk_tokens=64)
    write_synthetic_shard(store, 1, num_samples=5)
    ours = store.read_shard(1)
    group = zarr.open_group(str(tmp_path), mode="r")
    assert group.attrs["dflash"]["format_version"] == 1
    shard = group["shards/00001"]
    np.testing.assert_array_equal(shard["input_ids"][:], ours.input_ids)
    np.testing.assert_array_equal(shard["loss_mask"][:], ours.loss_mask)
    np.testing.assert_array_equal(shard["offsets"][:], ours.offsets)
    np.testing.assert_array_equal(shard["sample_ids"][:], ours.sample_ids)
    assert shard["features"].attrs["logical_dtype"] == "bfloat16"
    if codec == "fp8":
        q = torch.from_numpy(shard["features"][:]).view(torch.float8_e4m3fn).float()
        decoded = (q * torch.from_numpy(shard["feature_scales"][:]).unsqueeze(-1)).bfloat16()
        assert torch.equal(decoded.view(torch.int16), ours.features.view(torch.int16))
    elif codec == "uq6":  # as its attributes say: zigzagged 16-bit integers times the row's step
        assert shard["features"].attrs["encoding"] == "int16_zigzag_times_step"
        z = shard["features"][:].astype(np.int64)
        q = (z >> 1) ^ -(z & 1)
        decoded = torch.from_numpy((q * shard["feature_scales"][:][..., None]).astype(np.float32)).bfloat16()
        assert torch.equal(decoded.view(torch.int16), ours.features.view(torch.int16))
    else:
        np.testing.assert_array_equal(shard["features"][:], bits_of(ours.features))


def test_codecs_sizes_and_fp8_error(tmp_path):
    sizes = {}
    for codec in ("none", "blosc", "fp8"):
        store = Store.create_or_open(str(tmp_path / codec), header(codec))
        sizes[codec] = write_synthetic_shard(store, 0, num_samples=8)["bytes"]
        data = store.read_shard(0)
        for i in range(data.num_samples):
            ids, mask, bits = synthetic_sample(0, i, L, H)
            ref = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
            got = data.sample(i)[2].float()
            if codec == "fp8":
                rel = ((got - ref).norm() / ref.norm()).item()
                assert 0 < rel < 0.05, rel  # lossy, but within e4m3's 3 mantissa bits
            else:
                assert torch.equal(got, ref)
    assert sizes["fp8"] < sizes["blosc"] < sizes["none"], sizes


def _shard_files(root, shard_id: int) -> dict[str, bytes]:
    shard = root / f"shards/{shard_id:05d}"
    return {str(p.relative_to(shard)): p.read_bytes() for p in sorted(shard.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("codec", ["fp8", "uq6"])
def test_features_encoded_by_the_caller_make_the_same_shard_bytes(tmp_path, codec):
    """Codes and scales handed to append (device_codec.encode_on_device's, sample by sample, as the CUDA extract
    pipeline makes them) commit the same chunk files, byte for byte, as the bf16 features the writer encodes."""
    from dflash.storage.device_codec import encode_on_device

    rng = np.random.default_rng(7)
    samples = []
    for i, t in enumerate([5, 23, 1, 16, 30, 9]):  # 16-token chunks: samples straddle them, the last is padded
        bits = activation_bits(rng, t, L, H)
        if i == 1:
            bits[2, 0] = 0  # a zero row
            bits[4, 1, 3] = 0x7FC0  # a row holding NaN
            bits[7, 2, 5] = 0xFF80  # a row holding -inf
            bits[8, 0, :] = 0x7F80  # a row of +inf
        ids = rng.integers(0, 50000, size=t, dtype=np.int32)
        samples.append((ids, rng.random(t) < 0.5, bits))
    store = Store.create_or_open(str(tmp_path), header(codec), chunk_tokens=16)
    records = []
    for shard_id, encoded in ((0, False), (1, True)):
        with store.try_claim(shard_id) as w:
            for i, (ids, mask, bits) in enumerate(samples):
                if encoded:
                    codes, scales = encode_on_device(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), codec)
                    if i % 2:  # numpy (uq: as the store's uint16) as well as tensors
                        codes, scales = codes.numpy().view(np.uint8 if codec == "fp8" else np.uint16), scales.numpy()
                    w.append(ids, mask, codes, sample_id=i, scales=scales)
                else:
                    w.append(ids, mask, bits, sample_id=i)
            records.append(w.commit())
    assert records[0]["files"] == records[1]["files"] and records[0]["arrays"] == records[1]["arrays"]
    assert records[0]["arrays"]["features"]["chunk_shape"][0] == 16 and len(records[0]["files"]) > 10
    files = [{k: v for k, v in _shard_files(tmp_path, i).items() if k != "zarr.json"} for i in (0, 1)]  # its id
    assert files[0] == files[1]
    assert torch.equal(store.read_shard(1).features.view(torch.int16), store.read_shard(0).features.view(torch.int16))


def test_encoded_append_refuses_scales_without_a_scaled_codec_mixed_kinds_and_wrong_dtypes(tmp_path):
    ids, mask, bits = np.arange(4), np.ones(4, bool), np.zeros((4, L, H), np.uint16)
    scales = np.ones((4, L), np.float32)
    with Store.create_or_open(str(tmp_path / "blosc"), header()).try_claim(0) as w:
        with pytest.raises(StoreError, match="codec 'blosc', which takes bf16 features only"):
            w.append(ids, mask, bits, sample_id=0, scales=scales)
    with Store.create_or_open(str(tmp_path / "fp8"), header("fp8")).try_claim(0) as w:
        with pytest.raises(StoreError, match="must be uint8 with float32 scales"):
            w.append(ids, mask, bits, sample_id=0, scales=scales)
        w.append(ids, mask, bits.astype(np.uint8), sample_id=0, scales=scales)
        with pytest.raises(StoreError, match="bf16 features appended to a shard begun with encoded features"):
            w.append(ids, mask, bits, sample_id=1)
    with Store.create_or_open(str(tmp_path / "uq6"), header("uq6")).try_claim(0) as w:
        w.append(ids, mask, bits, sample_id=0)
        with pytest.raises(StoreError, match="encoded features with scales appended to a shard begun with bf16"):
            w.append(ids, mask, bits, sample_id=1, scales=scales)
    with Store.open(str(tmp_path / "uq6")).try_claim(1) as w:
        with pytest.raises(StoreError, match=r"scales \[t, L\]; found .*, scales \[3, 3\]"):
            w.append(ids, mask, bits, sample_id=0, scales=scales[:3])


def test_trimmed_mantissa_codec_bounds_error_keeps_specials_and_shrinks(tmp_path):
    from dflash.storage.codec import trim_mantissa

    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 1 << 16, 4000, dtype=np.uint16), SPECIALS])
    trimmed = trim_mantissa(bits, 3)
    special = (bits & 0x7F80) == 0x7F80
    assert not np.any(trimmed[~special] & 0x000F)  # 4 low mantissa bits dropped from every finite value...
    np.testing.assert_array_equal(trimmed[special] | (bits[special] & 0x000F), bits[special])  # ...inf/NaN kept
    x = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    y = torch.from_numpy(trimmed.view(np.int16)).view(torch.bfloat16).float()
    finite = torch.isfinite(x) & (x != 0)
    assert torch.isfinite(y[finite]).all()  # never rounded up to inf
    normal = finite & (x.abs() >= torch.finfo(torch.bfloat16).tiny) & (x.abs() < 3.3e38)  # below the top binade
    assert ((y - x).abs()[normal] <= x.abs()[normal] / 16).all()  # round to nearest: at most half of 2^-3
    np.testing.assert_array_equal(trim_mantissa(trimmed, 3), trimmed)  # idempotent
    sizes = {}
    for codec in ("blosc", "bf16m3", "bf16m2", "bf16m1"):
        store = Store.create_or_open(str(tmp_path / codec), header(codec))
        sizes[codec] = write_synthetic_shard(store, 0, num_samples=8)["bytes"]
        data = store.read_shard(0)
        ids, mask, ref_bits = synthetic_sample(0, 1, L, H)
        want = trim_mantissa(ref_bits, int(codec[-1])) if codec != "blosc" else ref_bits
        np.testing.assert_array_equal(bits_of(data.sample(1)[2]), want)  # read == written, trimmed
    assert sizes["bf16m1"] < sizes["bf16m2"] < sizes["bf16m3"] < sizes["blosc"], sizes


def test_uniform_quantizer_bounds_each_value_by_half_a_step_and_beats_fp8(tmp_path):
    from dflash.storage.codec import ZIGZAG_MAX, to_uq, uq_to_bf16_bits
    from dflash.tests.synthetic_shards import activation_bits

    bits = activation_bits(np.random.default_rng(3), 700, 5, 512)
    x = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    for divisor in (4, 6, 8):
        z, step = to_uq(bits, divisor)
        assert z.dtype == np.uint16 and step.shape == (700, 5)
        mag = x.abs()
        want = torch.maximum(mag[..., ::2].median(dim=-1).values / divisor, mag.amax(dim=-1) / ZIGZAG_MAX)
        assert torch.allclose(torch.from_numpy(step), want)
        back = np.empty_like(bits)
        uq_to_bf16_bits(z, step, back)
        y = torch.from_numpy(back.view(np.int16)).view(torch.bfloat16).float()
        s = torch.from_numpy(step).unsqueeze(-1)
        # Round to nearest: within half a step, plus the bf16 rounding of the decoded value.
        assert ((y - x).abs() <= s / 2 + y.abs() / 256 + 1e-30).all()
        q = (y / s).round()  # the stored integers, read back through the decoded values
        assert torch.equal(q, torch.round(x * (1 / s)))
    # A row of zeros decodes exactly; a row with NaN or inf decodes to NaN, never to plausible numbers; a row with a
    # dynamic range past 15 bits takes the coarser step amax / 32767 and keeps its largest value.
    rows = torch.zeros(4, 1, 64)
    rows[1, 0, 3], rows[2, 0, 5] = float("nan"), float("inf")
    rows[3, 0] = torch.linspace(-1, 1, 64)
    rows[3, 0, 0] = 1e9
    rb = rows.bfloat16().view(torch.int16).numpy().view(np.uint16)
    z, step = to_uq(rb, 6)
    back = np.empty_like(rb)
    uq_to_bf16_bits(z, step, back)
    y = torch.from_numpy(back.view(np.int16)).view(torch.bfloat16).float()
    assert torch.equal(y[0], rows[0]) and step[0, 0] == 1
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert step[3, 0] == pytest.approx(rows[3].bfloat16().float().abs().max().item() / ZIGZAG_MAX)
    assert y[3, 0, 0].item() == pytest.approx(rows[3, 0, 0].bfloat16().item(), rel=1 / 128)
    # The ends of the float range: a row of values near 1e-39 (its step would be subnormal, 1 / step inf) and a row near
    # bf16's largest (rounding up half a step must not reach inf) both stay within half a step.
    ends = torch.tensor([[[1e-39, -2e-39, 0, 3e-39, 0, 0, 1e-39, 0]], [[3.3895e38] + [2.8e38] * 7]])
    eb = ends.bfloat16().view(torch.int16).numpy().view(np.uint16)
    for divisor in (4, 6, 8):
        z, step = to_uq(eb, divisor)
        back = np.empty_like(eb)
        uq_to_bf16_bits(z, step, back)
        x = ends.bfloat16().float()
        y = torch.from_numpy(back.view(np.int16)).view(torch.bfloat16).float()
        assert torch.isfinite(y).all(), y
        assert ((y - x).abs() <= torch.from_numpy(step).unsqueeze(-1) / 2 + x.abs() / 128).all(), (x, y)
    # A few channels hundreds of times the rest leave the bulk of a row its precision (a step from the row's RMS would
    # be 16x coarser here). A row whose largest value is over 32767 steps (uq6: 5,461x its median magnitude, as the
    # massive activations of a few tokens can be) takes the coarser step amax / 32767 instead, tested above.
    g = torch.Generator().manual_seed(1)
    heavy = torch.randn(64, 2, 1024, generator=g)
    heavy[..., :3] *= 300
    hb = heavy.bfloat16().view(torch.int16).numpy().view(np.uint16)
    z, step = to_uq(hb, 6)
    back = np.empty_like(hb)
    uq_to_bf16_bits(z, step, back)
    ref = heavy.bfloat16().float()
    got = torch.from_numpy(back.view(np.int16)).view(torch.bfloat16).float()
    bulk = ((got - ref)[..., 3:].norm(dim=-1) / ref[..., 3:].norm(dim=-1)).max().item()
    assert bulk < 0.04, bulk
    # Stored and read back through the store, on activation-shaped rows: fewer bytes than fp8 at no more error.
    sizes, errors = {}, {}
    for codec in ("fp8", "uq8", "uq6", "uq4"):
        store = Store.create_or_open(str(tmp_path / codec), header(codec))
        sizes[codec] = write_synthetic_shard(store, 0, num_samples=8)["bytes"]
        data = store.read_shard(0)
        ids, mask, ref_bits = synthetic_sample(0, 1, L, H)
        ref = torch.from_numpy(ref_bits.view(np.int16)).view(torch.bfloat16).float()
        got = data.sample(1)[2].float()
        errors[codec] = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()
        if codec != "fp8":
            z, step = to_uq(ref_bits, int(codec[2:]))
            want = np.empty_like(ref_bits)
            uq_to_bf16_bits(z, step, want)
            np.testing.assert_array_equal(bits_of(data.sample(1)[2]), want)  # read == written, quantized
    assert sizes["uq4"] < sizes["uq6"] < sizes["uq8"] < sizes["fp8"], sizes
    assert errors["uq8"] < errors["uq6"] < errors["uq4"] < 0.05, errors
    assert errors["uq8"] < errors["fp8"], errors


def test_lossy_codecs_are_torchs_conversions_bit_for_bit_in_numpy_without_torch(tmp_path):
    """The scaled codecs run in the store's reader and writer threads, beside a forward or a training step: numpy
    there (torch's intra-op threads, one team a calling thread, took 2.6x a GPU training step from a uq6 store,
    bench/RESULTS.md). Each conversion equals torch's own, bit for bit: float32 to float8_e4m3fn and to bf16 (to
    nearest, ties to even, saturating at 448), fp8 to float32, and uq's steps and integers; and a store's
    round trip through them never imports torch."""
    from dflash.storage import codec

    g = np.random.default_rng(5)
    n = 400_000
    mags = g.standard_normal(n).astype(np.float32) * (np.float32(10) ** g.integers(-12, 3, n).astype(np.float32))
    # Ties of fp8's 3-bit and bf16's 7-bit mantissas, and their neighbours, over every exponent fp8 reaches.
    ties = ((g.integers(100, 136, n).astype(np.uint32) << 23) | (g.integers(0, 16, n).astype(np.uint32) << 19)
            | (g.integers(0, 2, n).astype(np.uint32) << 31))
    specials = np.array([0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448, -448, 449, 464, 479.9, 480, 1e30, 2.0**-6,
                         2.0**-9, 2.0**-10, 3 * 2.0**-10, 1e-45, 3.3895313892515355e38], np.float32)
    vals = np.concatenate([mags, ties.view(np.float32), (ties | 0xFFFF).view(np.float32), (ties | 0x8000).view(
        np.float32), specials])
    fp8_range = ~(np.abs(vals) > codec.FP8_MAX)  # to_fp8 clamps to it first (past it torch versions may differ)
    want = torch.from_numpy(vals[fp8_range]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(codec._fp8_bits(vals[fp8_range]), want)
    got = np.empty(vals.shape, np.uint16)
    codec._to_bf16_bits(vals, got)
    want16 = bits_of(torch.from_numpy(vals).bfloat16())
    nan = np.isnan(vals)
    np.testing.assert_array_equal(got[~nan], want16[~nan])
    assert ((got[nan] & 0x7FFF) > 0x7F80).all()
    table = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(codec._FP8_VALUES.view(np.uint32)[table == table], table.view(np.uint32)[
        table == table])  # -0.0 included
    assert np.isnan(codec._FP8_VALUES[np.isnan(table)]).all()
    from dflash.tests.synthetic_shards import activation_bits

    bits = activation_bits(g, 300, 3, 600)  # 600: a stride-2 median over 300 values, the lower of the middle two
    bits[7, 1] = 0  # a zero row: step 1
    bits[9, 0, 5] = 0x7F80  # inf: the row's step NaN
    bits[11, 2, :] = 0x0001  # subnormal: the step clamped to the smallest normal float32
    bits[13, 0, 0] = 0x7000  # 1.5e29 in a row of ones: past 32767 steps, so the step amax / 32767
    bits[13, 0, 1:] = 0x3F80
    x = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    z, step = codec.to_uq(bits, 6)
    amax = x.abs().amax(dim=-1)
    median = x.abs()[..., ::2].median(dim=-1).values  # torch's median is the lower middle value
    want = torch.maximum(median / 6, amax / codec.ZIGZAG_MAX)
    want = torch.where(want > 0, want.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(want))
    want = torch.where(torch.isfinite(amax), want, torch.full_like(want, float("nan")))
    assert torch.equal(torch.from_numpy(step).nan_to_num(-1.0), want.nan_to_num(-1.0))
    assert np.isnan(step[9, 0]) and step[7, 1] == 1 and step[13, 0] == want[13, 0] > median[13, 0] / 6
    s = torch.from_numpy(step).unsqueeze(-1)
    q = torch.round(x.nan_to_num(0.0, 0.0, 0.0) * torch.where(s.isnan(), 0.0, 1 / s)).clamp(
        -codec.ZIGZAG_MAX, codec.ZIGZAG_MAX).to(torch.int32)
    q[9, 0] = 0  # a non-finite row stores zeros
    assert torch.equal(torch.from_numpy(z.astype(np.int32)), ((q << 1) ^ (q >> 31)) & 0xFFFF)
    back = np.empty_like(bits)
    codec.uq_to_bf16_bits(z, step, back)
    ok = bits_of((q.float() * s).clamp(-3.3895313892515355e38, 3.3895313892515355e38).bfloat16())
    finite = ~np.isnan(step)
    np.testing.assert_array_equal(back[finite], ok[finite])
    assert ((back[~finite] & 0x7FFF) > 0x7F80).all()
    qf, scale = codec.to_fp8(bits)
    amax8 = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    scale8 = amax8 / codec.FP8_MAX  # the old torch encoder, step by step
    assert torch.equal(torch.from_numpy(scale), scale8)
    want8 = (x / scale8.unsqueeze(-1)).clamp(-codec.FP8_MAX, codec.FP8_MAX).to(torch.float8_e4m3fn)
    np.testing.assert_array_equal(qf, want8.view(torch.uint8).numpy())
    back = np.empty_like(bits)
    codec.fp8_to_bf16_bits(qf, scale, back)
    fp8 = torch.from_numpy(qf).view(torch.float8_e4m3fn).float()
    np.testing.assert_array_equal(back, bits_of((fp8 * torch.from_numpy(scale).unsqueeze(-1)).bfloat16()))
    script = (
        "import sys, numpy as np\n"
        "from dflash.storage import Store\n"
        "from dflash.storage.reader import read_features\n"
        "k = np.arange(2 * 96 * 3 * 32, dtype=np.uint64) * 2654435761 % 2**32\n"
        "bits = (0x3F80 | k % 128 | (k >> 7) % 2 << 15).astype(np.uint16)  # values of 1 to 2 of either sign\n"
        "f32 = lambda b: (b.astype(np.uint32) << 16).view(np.float32)\n"
        "bits = bits.reshape(2 * 96, 3, 32)\n"
        "for codec in ('uq6', 'fp8'):\n"
        "    store = Store.create_or_open(sys.argv[1] + '/' + codec, {'layer_ids': [1, 4, 7], 'hidden_size': 32,\n"
        "        'codec': codec, 'shard_plan': {'num_shards': 1}, 'target': {'path': 'tiny', 'config_hash': 'a'}})\n"
        "    with store.try_claim(0) as w:\n"
        "        for i in range(2):\n"
        "            w.append(np.zeros(96, np.int32), np.ones(96, bool), bits[i * 96:(i + 1) * 96], sample_id=i)\n"
        "        w.commit()\n"
        "    record = store.commit_record(0)\n"
        "    out = np.empty_like(bits)\n"
        "    read_features(store.fs, 0, record, 0, len(bits), out)\n"
        "    err = np.abs(f32(out) - f32(bits)).max()\n"
        "    assert 0 < err <= 0.125, (codec, err)  # lossy, within half a step (uq6: a sixth of 1.5)\n"
        "assert 'torch' not in sys.modules, 'the codecs imported torch'\n"
        "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_read_into_callers_buffer(tmp_path):
    store = Store.create_or_open(str(tmp_path), header())
    rec = write_synthetic_shard(store, 0, num_samples=4)
    buf = torch.empty(rec["num_tokens"] * L * H + 1000, dtype=torch.bfloat16)
    data = store.read_shard(0, out=buf)
    assert data.features.data_ptr() == buf.data_ptr()
    assert torch.equal(data.features.view(torch.int16), store.read_shard(0).features.view(torch.int16))
    with pytest.raises(StoreError, match="at least"):
        store.read_shard(0, out=torch.empty(10, dtype=torch.bfloat16))


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("codec", ["none", "blosc"])
def test_big_chunks_direct_io_into_aligned_and_unaligned_buffers(tmp_path, monkeypatch, codec, direct):
    # 2 MiB chunks take the O_DIRECT path when enabled (and the file system allows it); buffers must not matter.
    monkeypatch.setattr("dflash.storage.fs.DIRECT_IO", direct)
    hdr = {"layer_ids": [0, 1], "hidden_size": 1024, "codec": codec, "shard_plan": {"num_shards": 1}}
    store = Store.create_or_open(str(tmp_path), hdr, chunk_tokens=512)
    rec = write_synthetic_shard(store, 0, num_samples=6, max_len=600)
    n = rec["num_tokens"] * 2 * 1024
    big = torch.empty(n + 8192, dtype=torch.bfloat16)
    skip = (-big.data_ptr() % 4096) // 2
    for offset in (skip, skip + 1):  # page-aligned, then misaligned by one element
        data = store.read_shard(0, out=big[offset:])
        for i in range(6):
            np.testing.assert_array_equal(bits_of(data.sample(i)[2]), synthetic_sample(0, i, 2, 1024, 600)[2])
    chunk = tmp_path / "shards/00000/features/c.1.0.0"
    chunk.write_bytes(chunk.read_bytes()[:-4096])
    with pytest.raises(CorruptShard, match="c.1.0.0"):
        store.read_shard(0)


def test_empty_shard_commits(tmp_path):
    store = Store.create_or_open(str(tmp_path), header())
    with store.try_claim(3) as w:
        rec = w.commit({"note": "every row filtered"})
    assert rec["num_samples"] == 0 and rec["extra"] == {"note": "every row filtered"}
    data = store.read_shard(3)
    assert data.num_samples == 0 and tuple(data.features.shape) == (0, L, H) and list(data.offsets) == [0]
    assert store.verify(3) == []


def test_header_mismatch_names_every_field(tmp_path):
    Store.create_or_open(str(tmp_path), header())
    other = header(hidden_size=64) | {"layer_ids": [2, 5, 8], "target": {"path": "tiny", "config_hash": "zzz"}}
    with pytest.raises(ManifestMismatch) as e:
        Store.create_or_open(str(tmp_path), other)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg
    for part in ("hidden_size: store has 32, asked for 64", "layer_ids: store has [1, 4, 7], asked for [2, 5, 8]",
                 'target.config_hash: store has "abc", asked for "zzz"'):
        assert part in msg
    assert "codec" not in msg
    with pytest.raises(ManifestMismatch, match="codec"):
        Store.open(str(tmp_path), expected=header("fp8"))
    assert Store.create_or_open(str(tmp_path), header()).header["format_version"] == 1


def test_open_refuses_missing_unknown_version_and_bad_header(tmp_path):
    with pytest.raises(StoreError, match="no dflash store"):
        Store.open(str(tmp_path / "nope"))
    Store.create_or_open(str(tmp_path), header())
    meta = json.loads((tmp_path / "zarr.json").read_text())
    meta["attributes"]["dflash"]["format_version"] = 2
    (tmp_path / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="format version 2"):
        Store.open(str(tmp_path))
    with pytest.raises(StoreError, match="hidden_size must be a positive int"):
        Store.create_or_open(str(tmp_path / "x"), header(hidden_size=0))


def test_claims_commits_withdraw_and_gc(tmp_path):
    store = Store.create_or_open(str(tmp_path), header(num_shards=3))
    w = store.try_claim(0)
    assert w is not None and store.try_claim(0) is None  # held by a live process (us)
    w.append(*synthetic_sample(0, 0, L, H), sample_id=0)
    w.abort()  # released without commit: the data is garbage no reader sees
    assert store.committed_ids() == [] and (tmp_path / "shards/00000/features").exists()
    old = tmp_path / "commits" / "00009.json.1234.partial"
    old.write_text("{")
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # left by a run killed an hour ago
    fresh = tmp_path / "commits" / "00010.json.5678.partial"
    fresh.write_text("{")  # a live writer's record, a moment before its rename: gc must leave it
    assert store.gc() == {"shards": 1, "claims": 0, "partial": 1}
    assert fresh.exists() and not old.exists()
    assert not (tmp_path / "shards/00000").exists()
    for i in range(3):
        write_synthetic_shard(store, i, num_samples=2)
    assert store.committed_ids() == [0, 1, 2] and store.try_claim(1) is None
    assert not store.is_complete()
    store.mark_complete({"by": "test"})
    assert store.is_complete()
    assert store.withdraw(1) and store.committed_ids() == [0, 2] and not store.is_complete()
    with pytest.raises(StoreError, match=r"not committed \(\[1\]\)"):
        store.mark_complete()
    with pytest.raises(StoreError, match="outside the plan"):
        store.try_claim(3)


def test_claim_by_other_live_process_refused_dead_one_taken_over(tmp_path):
    store = Store.create_or_open(str(tmp_path), header())
    code = (
        "import sys, os; from dflash.storage import Store\n"
        f"w = Store.open({str(tmp_path)!r}).try_claim(1)\n"
        "print('claimed' if w else 'refused', flush=True)\n"
        "sys.stdin.readline(); os._exit(0)  # exit without releasing, like a crash\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "claimed"
    assert store.try_claim(1) is None  # the other process is alive
    mine = store.try_claim(2)
    out = subprocess.run([sys.executable, "-c", code.replace("try_claim(1)", "try_claim(2)")], input="\n",
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "refused"
    mine.abort()
    p.communicate("\n")
    taken = store.try_claim(1)  # the claimant died: its claim is stale
    assert taken is not None
    taken.commit()
    assert store.committed_ids() == [1]


def _foreign_claim(store, shard_id, *, age, lease=600.0, token="theirs"):
    record = {"host": "node-that-died", "pid": 1, "token": token, "time": time.time() - age}
    if lease is not None:
        record["lease_s"] = lease
    store.fs.write_atomic(f"claims/{shard_id:05d}.json", json.dumps(record).encode())


def test_another_hosts_claim_is_live_while_renewed_and_taken_over_once_its_lease_ran_out(tmp_path):
    store = Store.create_or_open(str(tmp_path), header(num_shards=3))
    _foreign_claim(store, 0, age=5)  # renewed 5 s ago: that writer is at work
    assert store.try_claim(0) is None
    _foreign_claim(store, 1, age=700)  # silent for longer than its lease: the machine is gone
    taken = store.try_claim(1)
    assert taken is not None
    taken.commit()
    _foreign_claim(store, 2, age=10 ** 6, lease=None)  # a claim from a dflash without leases: only an operator says
    assert store.try_claim(2) is None
    assert store.gc()["claims"] == 0 and store.committed_ids() == [1]


def test_a_writer_renews_its_claim_and_never_commits_a_shard_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv(claims.LEASE_ENV, "0.5")  # renewals every 0.1 s
    store = Store.create_or_open(str(tmp_path), header(num_shards=2))
    w = store.try_claim(0)
    first = claims.read_claim(store.fs, 0)
    assert first["lease_s"] == 0.5
    time.sleep(0.5)
    assert claims.read_claim(store.fs, 0)["time"] > first["time"]  # renewed while held
    w.commit()
    assert claims.read_claim(store.fs, 0) is None  # released at commit; no late renewal brings it back
    time.sleep(0.3)
    assert claims.read_claim(store.fs, 0) is None
    stalled = store.try_claim(1)
    _foreign_claim(store, 1, age=0, token="peer")  # a peer took it over while this writer stalled
    with pytest.raises(ClaimLost, match=r"claims/00001.json: expected this process's claim on shard 1 before its "
                                         r"commit, found it held by node-that-died \(pid 1\)"):
        stalled.commit()
    assert store.committed_ids() == [0]  # the shard is the peer's to commit
    assert claims.read_claim(store.fs, 1)["token"] == "peer"  # and its claim is left alone


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan"])
def test_a_bad_claim_lease_is_one_line(tmp_path, monkeypatch, value):
    store = Store.create_or_open(str(tmp_path), header(num_shards=1))
    monkeypatch.setenv(claims.LEASE_ENV, value)
    with pytest.raises(ConfigError, match=rf"^DFLASH_CLAIM_LEASE_S='{value}': expected a number of seconds > 0"):
        store.try_claim(0)
    assert list((tmp_path / "claims").iterdir()) == []


def test_an_interrupted_writer_releases_its_claims_and_its_half_written_claim(tmp_path, monkeypatch):
    store = Store.create_or_open(str(tmp_path), header(num_shards=3))
    assert store.try_claim(0) is not None  # held, never handed on: what a signal between claim and use leaves
    real = fs_module.write_durable

    def interrupted(path, data):
        real(path, data[: len(data) // 2])
        raise KeyboardInterrupt  # the signal lands mid-write of the next claim

    monkeypatch.setattr(fs_module, "write_durable", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.try_claim(1)
    monkeypatch.undo()
    other = tmp_path / "claims" / f"00002.json.1@{socket.gethostname().replace('.', '_')}.0badc0de.partial"
    other.write_text("{")  # another process's, in flight: not ours to remove
    crashed = tmp_path / "claims" / f"00002.json.{writer_tag()}.0badc0de.partial"
    crashed.write_text("{")  # ours, from a write the cleanup itself could not finish
    assert store.release_own_claims() == 1
    assert sorted(p.name for p in (tmp_path / "claims").iterdir()) == [other.name]
    assert store.try_claim(0) is not None and store.try_claim(1) is not None


def test_fsspec_memory_store_round_trip():
    url = f"memory://dflash-test-{uuid.uuid4().hex}/store"
    store = Store.create_or_open(url, header("blosc", num_shards=2), chunk_tokens=32)
    w = store.try_claim(0)
    assert w is not None and store.try_claim(0) is None  # exclusive create works there too
    w.abort()
    recs = [write_synthetic_shard(store, i, num_samples=3) for i in (0, 1)]
    store.mark_complete()
    again = Store.open(url, expected=header("blosc", num_shards=2))
    assert again.committed_ids() == [0, 1] and again.is_complete()
    assert list(follow_commits(again, poll=0.01)) == [0, 1]
    for i, rec in zip((0, 1), recs):
        data = again.read_shard(i)
        assert data.num_tokens == rec["num_tokens"]
        np.testing.assert_array_equal(bits_of(data.sample(2)[2]), synthetic_sample(i, 2, L, H)[2])
        assert again.verify(i) == []


def test_follow_yields_each_commit_once_then_ends(tmp_path):
    store = Store.create_or_open(str(tmp_path), header(num_shards=4))
    write_synthetic_shard(store, 2, num_samples=1)
    seen: list[int] = []
    late: list[int] = []
    follower = threading.Thread(target=lambda: seen.extend(follow_commits(store, poll=0.01, max_poll=0.05, timeout=60)))
    late_follower = threading.Thread(
        target=lambda: late.extend(follow_commits(store, poll=0.01, max_poll=0.05, include_existing=False, timeout=60))
    )
    follower.start()
    late_follower.start()
    for i in (0, 3, 1):
        write_synthetic_shard(store, i, num_samples=2)
    store.mark_complete()
    follower.join(30)
    late_follower.join(30)
    assert sorted(seen) == [0, 1, 2, 3] and len(seen) == 4
    assert sorted(late) == [0, 1, 3]


def test_follow_times_out_when_writers_stall(tmp_path):
    store = Store.create_or_open(str(tmp_path), header(num_shards=2))
    write_synthetic_shard(store, 0, num_samples=1)
    it = follow_commits(store, poll=0.01, max_poll=0.02, timeout=0.2)
    assert next(it) == 0
    with pytest.raises(StoreError, match="no shard committed"):
        next(it)


def test_chunk_size_is_per_shard(tmp_path):
    a = Store.create_or_open(str(tmp_path), header(), chunk_tokens=32)
    write_synthetic_shard(a, 0, num_samples=3)
    b = Store.open(str(tmp_path), chunk_tokens=1024)
    write_synthetic_shard(b, 1, num_samples=3)
    assert [b.commit_record(i)["chunk_tokens"] for i in (0, 1)] == [32, 1024]
    for i in (0, 1):
        np.testing.assert_array_equal(bits_of(b.read_shard(i).sample(1)[2]), synthetic_sample(i, 1, L, H)[2])
    assert os.path.exists(tmp_path / "shards/00000/features/c.0.0.0")
    via_url = Store.open(f"file://{tmp_path}")
    assert via_url.committed_ids() == [0, 1] and via_url.verify(1) == []


def test_takeover_lock_left_by_a_killed_process_does_not_block_the_shard(tmp_path):
    # A process killed while taking over a stale claim leaves its takeover lock behind; the shard must stay
    # claimable (before the fix, every later run skipped it and exited 0 with the store incomplete).
    from dflash.storage.claims import claim_path, read_claim

    store = Store.create_or_open(str(tmp_path), header())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = {"host": socket.gethostname(), "pid": dead_pid, "start_time": 1, "token": "stale", "time": 0.0}
    (tmp_path / claim_path(1)).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / claim_path(1)).write_text(json.dumps(stale))
    (tmp_path / f"{claim_path(1)}.takeover-stale.partial").write_text(json.dumps({**stale, "token": "locker"}))
    writer = store.try_claim(1)
    assert writer is not None, "a dead process's takeover lock blocked the shard"
    assert read_claim(store.fs, 1)["pid"] == os.getpid()
    writer.commit()
    assert store.committed_ids() == [1]
