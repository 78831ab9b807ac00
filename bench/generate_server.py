"""`dflash generate --server` against `transformers serve` beside the in-process fast engine: new tokens/s, same prompts.

Starts `transformers serve` on the target folder (the embedded SmolLM2 by default) on a loopback port, in the same
dtype as the in-process run, waits for it to answer, then runs `dflash generate --server` (each request a
/v1/chat/completions call, --concurrency in flight) and `dflash generate --model` (the fast engine, --batch-size slots)
over the same N prompts (the bundled demo/prompts.jsonl repeated to N), each one `dflash generate` subprocess as a
user runs it. Prints each path's new tokens/s (the stage's own count: generated tokens over the time spent
generating; model loading and the server's start-up excluded) and wall time, the ratio server / in-process, and how
many greedy answers are identical.

Here (CPU), from the repo root:

    python bench/generate_server.py --n 64 --max-new-tokens 64 --concurrency 16 --batch-size 16

On a GPU add `--device cuda --serve-args=--continuous-batching`.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# bench/generate.py's helpers: the work folder, the prompts, one `dflash` subprocess, its rate and its answers.
from generate import _RATE, _answers, _bundled, _dflash, _fresh, _save


def _serve(model: str, device: str, dtype: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, str, float]:
    """Start `transformers serve`; return the process, its URL and the seconds it took to answer /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--device", device, "--dtype", dtype, *extra]
    t = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=f, stderr=f)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"transformers serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url, time.perf_counter() - t
        except OSError:
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="target folder [default: the embedded SmolLM2]")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", help="both paths' dtype (generate's auto on a CPU is float32)")
    ap.add_argument("--n", type=int, default=64, help="prompts answered by each path")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight to the server")
    ap.add_argument("--batch-size", type=int, default=16, help="slots of the in-process fast engine")
    ap.add_argument("--serve-args", default="", help="more `transformers serve` options, e.g. --continuous-batching")
    ap.add_argument("--work", default="/tmp/dflash-bench-generate-server")
    args = ap.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    from dflash.demo.assets import smollm2_folder

    model = args.model or str(smollm2_folder())
    work = _fresh(args.work)
    prompts = work / "prompts.jsonl"
    _bundled(prompts, args.n)
    common = ["--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens)]
    result: dict = {"model": model, "device": args.device, "dtype": args.dtype, "n": args.n,
                    "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
                    "batch_size": args.batch_size, "serve_args": args.serve_args, "paths": {}}
    proc, url, up = _serve(model, args.device, args.dtype, args.serve_args.split(), work / "serve.log")
    print(f"transformers serve answered /health after {up:.1f} s", flush=True)
    runs = {
        "server": ["--server", url, "--concurrency", str(args.concurrency)],
        "in-process": ["--model", model, "--device", args.device, "--dtype", args.dtype, "--engine", "fast",
                       "--batch-size", str(args.batch_size)],
    }
    try:
        for name, extra in runs.items():
            wall, log = _dflash(["generate", *common, "--out", str(work / f"{name}.jsonl"), *extra], env)
            m = _RATE.search(log)
            assert m, log[-2000:]
            result["paths"][name] = {"tokens": int(m.group(2)), "tok_s": float(m.group(3)), "wall_s": round(wall, 1)}
            print(f"{name}: {int(m.group(2)):,} new tokens, {float(m.group(3)):,.1f} tok/s generating, {wall:.0f} s "
                  "wall", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    served, local = result["paths"]["server"], result["paths"]["in-process"]
    ans_s, ans_l = _answers(work / "server.jsonl"), _answers(work / "in-process.jsonl")
    same = sum(ans_s[r] == ans_l.get(r) for r in ans_s)
    result.update(ratio=served["tok_s"] / local["tok_s"], identical=same, compared=len(ans_s))
    print(f"RESULT server / in-process new tokens/s: {served['tok_s']:,.1f} / {local['tok_s']:,.1f} = "
          f"{result['ratio']:.2f}x; greedy answers identical: {same} of {len(ans_s)}", flush=True)
    _save(result, work, "generate_server.json")


if __name__ == "__main__":
    main()
