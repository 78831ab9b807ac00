"""Benchmark of `dflash extract` as a user runs it, beside the truncated forward over the same token batches.

    source bench/device_env.sh && python3 bench/extract.py --work /tmp/bx [--store-dir /dev/shm/bx] [--codec blosc]

One run: a random-init Qwen3-8B-shaped target saved as a Hugging Face folder (built once in --work), a
conversations file of mixed lengths (193-4,001 tokens, >= 1.5M tokens by default), then
  (1) `python -m dflash.cli extract --model M --data D --out STORE --gpus 0` as a subprocess, after `sync` and a
      page-cache drop (where allowed): its wall time, and from its summary the model load, the time to the first
      commit and the steady tok/s (first forward to last commit, every byte on disk);
  (2) the truncated forward (the target up to its last captured layer, nothing copied) over exactly the token
      batches the command ran (same tokenizer, template, shard plan and batch packing), in this process;
  (3) the raw write bandwidth of the store's folder (one large file, fsynced), for when the disk is the limit.
Prints each figure and the ratios the issue asks for: steady / forward, (tokens / (wall - load)) / forward, and the
command's bytes/s over the raw disk write.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dflash.testing import QWEN3_8B_CONFIG

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


def synthetic_samples(total_tokens: int, max_length: int, seed: int = 0) -> list:
    """Return pre-tokenized samples of lognormal lengths (for bench/topology.py), summing to ~total_tokens."""
    from dflash.extract.pipeline import Sample

    rng = np.random.default_rng(seed)
    out: list = []
    n = 0
    while n < total_tokens:
        t = int(np.clip(rng.lognormal(np.log(1300), 0.7), 64, max_length))
        ids = rng.integers(0, 151643, t, dtype=np.int32)
        mask = np.zeros(t, dtype=bool)
        mask[t // 3:] = True
        out.append(Sample(len(out), ids, mask))
        n += t
    return out


def make_target(folder: Path, device: torch.device, config: dict) -> None:
    """Write a random-init target of `config` with the test tokenizer (one token per character) to folder, once."""
    from dflash.testing import build_tokenizer

    if (folder / "config.json").is_file():
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = build_target(device, config)
    model.save_pretrained(tmp)
    build_tokenizer("chatml").save_pretrained(tmp)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    os.rename(tmp, folder)


def make_conversations(path: Path, total_tokens: int, seed: int = 0) -> None:
    """Write conversations of lognormal lengths (193-4,001 tokens: a prompt, then a twice as long answer), once."""
    if path.is_file():
        return
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz      "))
    lines, n = [], 0
    while n < total_tokens:
        t = int(np.clip(rng.lognormal(np.log(1300), 0.7), 193, 4001)) - 30  # ~30 template tokens
        text = "".join(rng.choice(letters, t))
        lines.append(json.dumps({"messages": [{"role": "user", "content": text[: t // 3]},
                                              {"role": "assistant", "content": text[t // 3:]}]}))
        n += t + 30
    path.write_text("\n".join(lines) + "\n")


def settle() -> bool:
    """Flush dirty pages and drop the page cache where allowed; return True if the cache was dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_command(model: Path, data: Path, store: Path, gpus: str, codec: str, log: Path) -> dict:
    """Return the wall time and the summary figures of `dflash extract` run as a subprocess."""
    shutil.rmtree(store, ignore_errors=True)
    cmd = [sys.executable, "-m", "dflash.cli", "extract", "--model", str(model), "--data", str(data),
           "--out", str(store), "--gpus", gpus, "--codec", codec]
    dropped = settle()
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log.write_text(done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    text = done.stderr
    tokens = int(re.search(r"samples, ([\d,]+) tokens", text).group(1).replace(",", ""))
    nbytes = float(re.search(r"tokens\), ([\d.]+) GB", text).group(1)) * 1e9
    load = float(re.search(r"model loaded in ([\d.]+) s", text).group(1))
    first = re.search(r"first commit ([\d.]+) s after that", text)
    steady = float(re.search(r"([\d,]+) tok/s to disk", text).group(1).replace(",", ""))
    forward = float(re.search(r"([\d,]+) tok/s forward", text).group(1).replace(",", ""))
    return {"command": " ".join(cmd), "wall_s": wall, "tokens": tokens, "bytes": nbytes, "load_s": load,
            "first_commit_s": float(first.group(1)) if first else None, "steady_tok_s": steady,
            "forward_side_tok_s": forward, "page_cache_dropped": dropped}


def truncated_forward(model_dir: Path, data: Path, store: Path, device: torch.device) -> dict:
    """Return tokens/s of the truncated forward alone over the batches the command ran (its shard plan and packing)."""
    from transformers import AutoTokenizer

    from dflash.config import ExtractConfig
    from dflash.extract.capture import TargetRunner, load_target, pad_batch
    from dflash.extract.data import read_rows
    from dflash.extract.plan import pack_batches, shard_ranges
    from dflash.extract.template import ChatEncoder, load_template
    from dflash.extract.worker import prepare_shard
    from dflash.storage import Store

    cfg = ExtractConfig(model=str(model_dir), data=(str(data),), out=str(store))
    header = Store.open(str(store)).header
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    encoder = ChatEncoder(tokenizer, load_template(tokenizer, None), cfg.max_length)
    rows = read_rows(cfg.data)
    batches = []
    for a, b in shard_ranges(len(rows), header["shard_plan"]["rows_per_shard"]):
        samples, _ = prepare_shard(rows[a:b], encoder, cfg.min_loss_tokens, False)
        lengths = [len(s.input_ids) for s in samples]
        batches += [pad_batch([samples[i].input_ids for i in idx], 0) for idx in pack_batches(lengths, cfg.batch_tokens)]
    runner = TargetRunner(load_target(cfg.model, device, torch.bfloat16), header["layer_ids"], check=False)
    tokens = sum(sum(lens) for _, lens in batches)
    settle()
    _sync(device)
    t0 = time.perf_counter()
    for ids, _ in batches:  # cold, like the command's first forward: no warm-up excluded on either side
        runner.hidden(ids.to(device, non_blocking=True))
    _sync(device)
    sec = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": sec, "tok_s": tokens / sec, "batches": len(batches)}


def disk_write_bandwidth(folder: Path, nbytes: int) -> float:
    """Return bytes/s of writing nbytes of incompressible data to one file in folder, fsync included."""
    path = folder / "raw-write.bin"
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < nbytes:
            done += f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return done / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="bench-extract-out", help="folder for the target, the data and the logs")
    ap.add_argument("--store-dir", default=None, help="folder for the store [default: --work]; /dev/shm for RAM")
    ap.add_argument("--tokens", type=int, default=1_550_000)
    ap.add_argument("--codec", default="blosc", choices=["blosc", "none", "fp8"])
    ap.add_argument("--raw-gb", type=float, default=8.0, help="size of the raw disk write (3); 0 skips it")
    ap.add_argument("--keep-store", action="store_true")
    ap.add_argument("--json", default=None, help="also write the figures as JSON here")
    ap.add_argument("--smoke", action="store_true", help="small Qwen3 on the CPU, few tokens: checks the script")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda:0")
    config = SMOKE_CONFIG if args.smoke else QWEN3_8B_CONFIG
    if args.smoke:
        args.tokens, args.raw_gb = min(args.tokens, 30_000), min(args.raw_gb, 0.05)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    store_root = Path(args.store_dir or work)
    store_root.mkdir(parents=True, exist_ok=True)
    model, data, store = work / "target", work / "conversations.jsonl", store_root / "store"
    t0 = time.perf_counter()
    make_target(model, device, config)
    make_conversations(data, args.tokens)
    print(f"target and {data.stat().st_size / 1e6:.1f} MB of conversations ready in {time.perf_counter() - t0:.1f} s",
          flush=True)

    cmd = run_command(model, data, store, "cpu" if args.smoke else "0", args.codec, work / f"extract-{args.codec}.log")
    print(f"(1) {cmd['command']}\n    wall {cmd['wall_s']:.1f} s, {cmd['tokens']:,} tokens, {cmd['bytes'] / 1e9:.2f} GB; "
          f"model load {cmd['load_s']:.1f} s, first commit {cmd['first_commit_s']} s after it; steady "
          f"{cmd['steady_tok_s']:,.0f} tok/s (forward side {cmd['forward_side_tok_s']:,.0f})", flush=True)
    fwd = truncated_forward(model, data, store, device)
    print(f"(2) truncated forward over the same {fwd['batches']} batches: {fwd['tok_s']:,.0f} tok/s "
          f"({fwd['seconds']:.1f} s)", flush=True)
    assert fwd["tokens"] == cmd["tokens"], (fwd["tokens"], cmd["tokens"])
    if not args.keep_store:
        shutil.rmtree(store, ignore_errors=True)
    raw = disk_write_bandwidth(store_root, int(args.raw_gb * 1e9)) if args.raw_gb > 0 else float("nan")
    if args.raw_gb > 0:
        print(f"(3) raw write + fsync in {store_root}: {raw / 1e9:.2f} GB/s", flush=True)
    whole = cmd["tokens"] / (cmd["wall_s"] - cmd["load_s"])
    figures = {
        **{k: v for k, v in cmd.items() if k != "command"}, "command": cmd["command"],
        "forward_tok_s": round(fwd["tok_s"]), "store_dir": str(store_root), "codec": args.codec,
        "steady_over_forward": round(cmd["steady_tok_s"] / fwd["tok_s"], 3),
        "whole_minus_load_tok_s": round(whole), "whole_minus_load_over_forward": round(whole / fwd["tok_s"], 3),
        "whole_tok_s": round(cmd["tokens"] / cmd["wall_s"]),
        "disk_raw_bytes_s": round(raw) if raw == raw else None,
        "steady_bytes_over_raw_disk": round(cmd["bytes"] / (cmd["tokens"] / cmd["steady_tok_s"]) / raw, 3)
        if raw == raw else None,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print("ratios: steady / forward = %.3f; (whole command - model load) / forward = %.3f; steady bytes/s / raw disk "
          "= %s" % (figures["steady_over_forward"], figures["whole_minus_load_over_forward"],
                    figures["steady_bytes_over_raw_disk"]))
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
