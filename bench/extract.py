"""Benchmark of `dflash extract` on one GPU: bare forward vs the pipeline without and with disk, and the disk itself.

    source bench/device_env.sh && python3 bench/extract.py [--dir DIR] [--tokens 473000]

A random-init Qwen3-8B-shaped target (built on the GPU in bf16), synthetic conversations with a realistic length
spread (the issue's 300 conversations, ~473K tokens), the default shard plan and the same token batches throughout:
  (a) bare `model.model` forward (all 36 layers + final norm, nothing captured), length-sorted batches;
  (b) the extract pipeline (truncated forward, pinned host copies on a side stream, writer thread) whose sink drops
      the features after the host copy;
  (c) the full pipeline into a real store on local disk with the default codec (blosc), commits included;
  (d) the disk's raw write bandwidth: one large file written and fsynced in the same folder.
Prints tokens/s, bytes/s, padding, disk wait and the ratios (b)/(a) and (c)/(d).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import numpy as np
import torch

from dflash.extract.capture import TargetRunner, pad_batch
from dflash.extract.pipeline import DiscardSink, FeaturePipeline, Sample
from dflash.extract.plan import default_shard_size, pack_batches, padding_fraction, shard_ranges
from dflash.extract.worker import WorkerSpec, fill_shards
from dflash.facts import build_target_layer_ids
from dflash.storage import Store
from dflash.testing import QWEN3_8B_CONFIG


def synthetic_samples(total_tokens: int, max_length: int, seed: int = 0) -> list[Sample]:
    """Return conversations of lognormal lengths (median ~1,300 tokens, clipped to max_length) summing to ~total."""
    rng = np.random.default_rng(seed)
    out: list[Sample] = []
    n = 0
    while n < total_tokens:
        t = int(np.clip(rng.lognormal(np.log(1300), 0.7), 64, max_length))
        ids = rng.integers(0, 151643, t, dtype=np.int32)
        mask = np.zeros(t, dtype=bool)
        mask[t // 3 :] = True  # an answer after a prompt
        out.append(Sample(len(out), ids, mask))
        n += t
    return out


# --smoke: the same code path on the CPU with a small Qwen3, to check the script before spending GPU time.
SMOKE_CONFIG = {**QWEN3_8B_CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_target(device: torch.device, config: dict):
    """Return a random-init Qwen3 causal LM of this config in bf16, built directly on the device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**config)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def bare_forward(model, shards: list[list[Sample]], batch_tokens: int, device) -> tuple[float, int, int]:
    """Return (seconds, real tokens, padded tokens) of model.model over the same length-sorted batches."""
    real = padded = 0
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for samples in shards:
            lengths = [len(s.input_ids) for s in samples]
            for idx in pack_batches(lengths, batch_tokens):
                ids, _ = pad_batch([samples[i].input_ids for i in idx], 0)
                model.model(input_ids=ids.to(device, non_blocking=True), use_cache=False)
                real += sum(lengths[i] for i in idx)
                padded += ids.numel()
    _sync(device)
    return time.perf_counter() - t0, real, padded


def disk_write_bandwidth(folder: str, nbytes: int) -> float:
    """Return bytes/s of writing nbytes of incompressible data to one file in folder, fsync included."""
    path = os.path.join(folder, "raw-write.bin")
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < nbytes:
            done += f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.remove(path)
    return done / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="bench-extract-out", help="folder on the local disk for the store and (d)")
    ap.add_argument("--tokens", type=int, default=473_000)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--raw-gb", type=float, default=8.0, help="size of the raw disk write (d)")
    ap.add_argument("--json", default=None, help="also write the figures as JSON here")
    ap.add_argument("--smoke", action="store_true", help="small Qwen3 on the CPU, few tokens: checks the script")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    config = SMOKE_CONFIG if args.smoke else QWEN3_8B_CONFIG
    if args.smoke:
        args.tokens, args.raw_gb, args.batch_tokens = min(args.tokens, 12_000), min(args.raw_gb, 0.1), 4096
    os.makedirs(args.dir, exist_ok=True)

    t0 = time.perf_counter()
    model = build_target(device, config)
    layer_ids = build_target_layer_ids(config["num_hidden_layers"])
    H = config["hidden_size"]
    samples = synthetic_samples(args.tokens, min(args.max_length, args.batch_tokens))
    mean_len = sum(len(s.input_ids) for s in samples) / len(samples)
    rows_per_shard = default_shard_size(mean_len, len(layer_ids) * H * 2)
    ranges = shard_ranges(len(samples), rows_per_shard)
    shards = [samples[a:b] for a, b in ranges]
    print(f"target built in {time.perf_counter() - t0:.1f} s; {len(samples)} samples, "
          f"{sum(len(s.input_ids) for s in samples):,} tokens, {len(shards)} shards of {rows_per_shard} rows", flush=True)

    # Warm up kernels and the allocator on the first shard (not timed).
    bare_forward(model, shards[:1], args.batch_tokens, device)

    sec_a, real, padded = bare_forward(model, shards, args.batch_tokens, device)
    tok_a = real / sec_a
    pad = 1 - real / padded
    pad_plan = np.mean([padding_fraction([len(s.input_ids) for s in sh], pack_batches([len(s.input_ids) for s in sh], args.batch_tokens)) for sh in shards])
    print(f"(a) bare model.model forward: {tok_a:,.0f} tok/s ({sec_a:.1f} s), padding {100 * pad:.2f}%", flush=True)

    runner = TargetRunner(model, layer_ids)  # truncates the model: (a) must run before this
    # (a2) the truncated forward alone (no gather, no copies): separates depth savings from pipeline overheads.
    _sync(device)
    t0 = time.perf_counter()
    for sh in shards:
        lengths = [len(s.input_ids) for s in sh]
        for idx in pack_batches(lengths, args.batch_tokens):
            ids, _ = pad_batch([sh[i].input_ids for i in idx], 0)
            runner.hidden(ids.to(device, non_blocking=True))
    _sync(device)
    tok_a2 = real / (time.perf_counter() - t0)
    print(f"(a2) truncated forward to layer {max(layer_ids)}, nothing copied: {tok_a2:,.0f} tok/s", flush=True)
    pipeline = FeaturePipeline(runner, args.batch_tokens)
    pipeline.run(shards[0], DiscardSink())  # warm-up of the truncated path
    _sync(device)
    t0 = time.perf_counter()
    wait_b = 0.0
    for sh in shards:
        wait_b += pipeline.submit(sh, DiscardSink()).wait_s
    wait_b += pipeline.drain()
    _sync(device)
    sec_b = time.perf_counter() - t0
    tok_b = real / sec_b
    print(f"(b) pipeline, features discarded after the host copy: {tok_b:,.0f} tok/s ({sec_b:.1f} s), "
          f"waited {wait_b:.2f} s", flush=True)

    store_dir = os.path.join(args.dir, "store")
    shutil.rmtree(store_dir, ignore_errors=True)
    header = {
        "kind": "bench", "layer_ids": layer_ids, "hidden_size": H, "codec": "blosc", "feature_dtype": "bfloat16",
        "shard_plan": {"num_rows": len(samples), "rows_per_shard": rows_per_shard, "num_shards": len(shards)},
    }
    store = Store.create_or_open(store_dir, header)
    spec = WorkerSpec(device=str(device), index=0, header=store.header)
    t0 = time.perf_counter()
    result = fill_shards(store, lambda sid: (shards[sid], {"rows": list(ranges[sid])}), pipeline, lambda e: None, spec)
    sec_c = time.perf_counter() - t0
    nbytes = sum(store.commit_record(s)["bytes"] for s in store.committed_ids())
    raw_bytes = real * len(layer_ids) * H * 2
    tok_c = real / sec_c
    bps_c = nbytes / sec_c
    print(f"(c) full pipeline to disk (blosc): {tok_c:,.0f} tok/s ({sec_c:.1f} s), {bps_c / 1e9:.2f} GB/s on disk, "
          f"{nbytes / real:,.0f} bytes/token (raw bf16 {raw_bytes / real:,.0f}, ratio {raw_bytes / nbytes:.2f}x), "
          f"waited {result['wait_s']:.2f} s on the writers", flush=True)
    shutil.rmtree(store_dir, ignore_errors=True)

    bps_d = disk_write_bandwidth(args.dir, int(args.raw_gb * 1e9))
    print(f"(d) raw disk write + fsync: {bps_d / 1e9:.2f} GB/s", flush=True)

    figures = {
        "tokens": real, "samples": len(samples), "shards": len(shards),
        "a_tok_s": round(tok_a), "a2_tok_s": round(tok_a2), "b_tok_s": round(tok_b), "c_tok_s": round(tok_c),
        "c_disk_bytes_s": round(bps_c), "d_disk_bytes_s": round(bps_d),
        "b_over_a": round(tok_b / tok_a, 3), "b_over_a2": round(tok_b / tok_a2, 3), "c_over_a": round(tok_c / tok_a, 3), "c_bytes_over_d": round(bps_c / bps_d, 3),
        "padding": round(pad, 4), "padding_plan_mean": round(float(pad_plan), 4),
        "c_wait_s": round(result["wait_s"], 2), "bytes_per_token": round(nbytes / real), "compression": round(raw_bytes / nbytes, 3),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
    }
    print("ratios: (b)/(a) = %.3f, (c)/(a) = %.3f, (c) disk bytes/s / (d) = %.3f, padding %.2f%%"
          % (figures["b_over_a"], figures["c_over_a"], figures["c_bytes_over_d"], 100 * pad))
    print(json.dumps(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
