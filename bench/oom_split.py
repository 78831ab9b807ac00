"""`dflash extract` on a GPU that another process mostly holds, through the real command (issue 39, point 4).

    source bench/device_env.sh && python3 bench/oom_split.py --work /tmp/boom
    python3 bench/oom_split.py --smoke --work /tmp/boom-smoke   # the CPU: extract's test hook stands in for the GPU

A random-init Qwen3-shaped target (hidden 2,048, 24 layers, ~2.3B parameters, the test tokenizer: one token a
character) is written once in --work; then, each as a subprocess:
  (1) reference: `extract --batch-tokens 65536 --shard-weights 1` with the GPU free;
  (2) split: the same command while a filler process holds the GPU's memory but for the weights and --headroom-gib:
      a batch that does not fit is split (one warning naming the sizes), the command exits 0, `dflash verify` passes,
      and the store holds the same rows as (1) with features within two bf16 roundings; its tok/s beside (1)'s;
  (3) alone: rows of --long-tokens tokens each, the filler leaving --alone-headroom-gib: the command ends with one
      line (exit 2) naming a row, its length and the free memory; the same command without the filler then resumes
      and completes the store (`dflash verify`, every row once).
In --smoke no filler runs: DFLASH_TEST_OOM_TOKENS (extract's test hook) makes the same forwards fail on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import extract as bx  # noqa: E402  (bench/extract.py: the target folder, the conversations)

CONFIG = dict(vocab_size=151936, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
              rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
FILLER = ("import sys, time, torch\n"
          "x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda')\n"
          "print('held', flush=True)\n"
          "time.sleep(3600)\n")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


class Filler:
    """A process holding all of the GPU's free memory but `leave` bytes (what another job on a shared GPU does)."""

    def __init__(self, leave: int) -> None:
        free, _ = torch.cuda.mem_get_info(0)
        self.held = max(0, free - leave)
        self.proc = subprocess.Popen([sys.executable, "-c", FILLER, str(self.held)], stdout=subprocess.PIPE,
                                     text=True)
        if self.proc.stdout.readline().strip() != "held":
            raise SystemExit("the filler process could not allocate its memory")
        self.free_after = torch.cuda.mem_get_info(0)[0]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        time.sleep(1)


def extract(model: Path, data: Path, out: Path, gpus: str, flags: list[str], env: dict | None = None) -> dict:
    """Return the exit code, wall time, stderr and summary figures of one `dflash extract` subprocess."""
    cmd = [sys.executable, "-m", "dflash.cli", "--log-level", "info", "extract", "--model", str(model), "--data",
           str(data), "--out", str(out), "--gpus", gpus, *flags]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    err = done.stderr
    steady = re.search(r"([\d,]+) tok/s to disk", err)
    return {"command": " ".join(cmd), "code": done.returncode, "wall_s": round(wall, 1), "stderr": err,
            "tok_s": float(steady.group(1).replace(",", "")) if steady else None,
            "errors": [ln for ln in err.splitlines() if ln.startswith("dflash: error:")],
            "splits": [ln for ln in err.splitlines() if "ran out of memory" in ln and "forwards of at most" in ln]}


def verify(store: Path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "verify", str(store)], capture_output=True, text=True)
    return done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1]


def rows_and_features(store: Path) -> dict[int, np.ndarray]:
    """Return each source row's features (bf16 bits as float32) of a store."""
    from dflash.storage import Store

    st = Store.open(str(store))
    out: dict[int, np.ndarray] = {}
    for sid in st.committed_ids():
        d = st.read_shard(sid)
        bits = d.features.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        feats = bits.view(np.float32)
        for k, row in enumerate(d.sample_ids.tolist()):
            if int(row) in out:
                raise SystemExit(f"{store}: row {row} stored twice")
            out[int(row)] = feats[int(d.offsets[k]):int(d.offsets[k + 1])]
    return out


def compare(a: Path, b: Path) -> str:
    fa, fb = rows_and_features(a), rows_and_features(b)
    if sorted(fa) != sorted(fb):
        return f"DIFFERENT rows: {len(fa)} vs {len(fb)}"
    worst = 0.0
    for row in fa:
        x, y = fa[row], fb[row]
        scale = np.abs(y).max() or 1.0
        worst = max(worst, float((np.abs(x - y) / (np.abs(y) + 1e-3 * scale)).max()))
    return f"same {len(fa)} rows; largest relative difference {worst:.2e} (two bf16 roundings: {2 * 2 ** -8:.2e})"


def long_rows(path: Path, tokens: int, rows: int) -> None:
    rng = np.random.default_rng(1)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz      "))
    with open(path, "w") as f:
        for _ in range(rows):
            text = "".join(rng.choice(letters, tokens - 40))
            f.write(json.dumps({"messages": [{"role": "user", "content": text[:100]},
                                             {"role": "assistant", "content": text[100:]}]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", type=int, default=600_000, help="tokens of conversations for (1) and (2)")
    ap.add_argument("--headroom-gib", type=float, default=5.0, help="(2): GPU memory left beyond the weights")
    ap.add_argument("--alone-headroom-gib", type=float, default=5.0, help="(3): GPU memory left beyond the weights")
    ap.add_argument("--starved-headroom-gib", type=float, default=0.5,
                    help="(4): GPU memory left beyond the weights, too little for the start-up check")
    ap.add_argument("--long-tokens", type=int, default=65536, help="(3): tokens of each long row")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda:0")
    model = work / ("target-smoke" if smoke else "target")
    bx.make_target(model, device, SMOKE if smoke else CONFIG)
    tokens = 20_000 if smoke else args.tokens
    long_tokens = 2_000 if smoke else args.long_tokens
    data, long_data = work / f"conv-{tokens}.jsonl", work / f"long-{long_tokens}.jsonl"
    bx.make_conversations(data, tokens)
    long_rows(long_data, long_tokens, 4)
    gpus = "cpu" if smoke else "0"
    batch = ["--batch-tokens", "8192" if smoke else "65536", "--shard-weights", "1", "--max-length", "4096"]
    weights = folder_bytes(model)
    print(f"target: {model} ({weights / 2**30:.2f} GiB of weights), {'CPU smoke' if smoke else torch.cuda.get_device_name(0)}")

    ref = extract(model, data, work / "ref", gpus, batch)
    print(f"(1) reference: exit {ref['code']}, {ref['wall_s']} s, {ref['tok_s']} tok/s to disk\n    {ref['command']}")
    if ref["code"]:
        raise SystemExit(ref["stderr"][-3000:])

    filler = None if smoke else Filler(weights + int(args.headroom_gib * 2**30))
    if filler:
        print(f"    filler holds {filler.held / 2**30:.1f} GiB; {filler.free_after / 2**30:.1f} GiB free for the command")
    try:
        split = extract(model, data, work / "split", gpus, batch, env={"DFLASH_TEST_OOM_TOKENS": "4096"} if smoke else None)
    finally:
        if filler:
            filler.stop()
    print(f"(2) split: exit {split['code']}, {split['wall_s']} s, {split['tok_s']} tok/s to disk "
          f"({(split['tok_s'] or 0) / (ref['tok_s'] or 1):.3f}x the reference)")
    for line in split["splits"] + split["errors"]:
        print("    " + line.split(": ", 1)[-1] if "WARNING" in line else "    " + line)
    if split["code"] == 0:
        print(f"    verify: {verify(work / 'split')}")
        print(f"    against (1): {compare(work / 'split', work / 'ref')}")
    else:
        print(split["stderr"][-3000:])

    alone_flags = ["--batch-tokens", str(long_tokens), "--shard-weights", "1", "--max-length", str(long_tokens)]
    filler = None if smoke else Filler(weights + int(args.alone_headroom_gib * 2**30))
    try:
        alone = extract(model, long_data, work / "alone", gpus, alone_flags,
                        env={"DFLASH_TEST_OOM_TOKENS": str(long_tokens // 2)} if smoke else None)
    finally:
        if filler:
            filler.stop()
    print(f"(3) a row alone: exit {alone['code']} ({len(alone['errors'])} error line(s), "
          f"{'a traceback' if 'Traceback' in alone['stderr'] else 'no traceback'})")
    for line in alone["errors"]:
        print("    " + line)
    if alone["code"] != 2 or "Traceback" in alone["stderr"]:
        print(alone["stderr"][-4000:])
    rerun = extract(model, long_data, work / "alone", gpus, alone_flags)
    print(f"    the same command without the filler: exit {rerun['code']}, {rerun['wall_s']} s; "
          f"verify: {verify(work / 'alone') if rerun['code'] == 0 else rerun['stderr'][-2000:]}")
    if rerun["code"] == 0:
        print(f"    rows in the store: {len(rows_and_features(work / 'alone'))} of 4, each once")
    if smoke:
        return
    # (4) so little memory that the target's start-up check cannot run: one line, not a traceback (2026-12-05's
    # first run of (3) ended in one).
    filler = Filler(weights + int(args.starved_headroom_gib * 2**30))
    try:
        starved = extract(model, data, work / "starved", gpus, batch)
    finally:
        filler.stop()
    print(f"(4) starved ({args.starved_headroom_gib} GiB beyond the weights): exit {starved['code']} "
          f"({len(starved['errors'])} error line(s), {'a traceback' if 'Traceback' in starved['stderr'] else 'no traceback'}); "
          f"store left: {(work / 'starved').exists()}")
    for line in starved["errors"]:
        print("    " + line)
    if starved["code"] != 2 or "Traceback" in starved["stderr"]:
        print(starved["stderr"][-4000:])


if __name__ == "__main__":
    main()
