"""What fp8 features cost the drafter: the demo's recipe trained from its blosc store and from an fp8 store.

Takes a finished `dflash demo` folder (its data, its lossless blosc store, its drafter, its decoding), extracts the
same data again with `--codec fp8`, trains the same drafter with the same settings (the demo's own stage configs,
`demo.extract_config` / `demo.train_config`), and scores both arms the same way, in one run:

- held-out tau_hat: `dflash eval` on the held-out shards (the same ids, so the same held-out prompts) of the
  lossless store, i.e. on exact features as serving gives them, and on the fp8 store;
- measured tau: speculative against greedy decoding (fp32) of the same held-out prompts as the demo decoded.

Prints one line per arm and the ratios fp8 / blosc. On the 2-core CPU, after `dflash demo` (the full budget):

    DFLASH_CACHE=... python bench/fp8_price.py --demo dflash-demo --work /tmp/fp8 --json /tmp/fp8/price.json

On a GPU, after `dflash demo --device cuda`, add `--device cuda`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", required=True, help="a finished `dflash demo` output folder")
    ap.add_argument("--work", required=True, help="folder for the fp8 store, run, drafter and decoding (resumable)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()

    from dflash import demo
    from dflash.demo.assets import smollm2_folder
    from dflash.config import DemoConfig, EvalConfig
    from dflash.demo.data import DATA_FILE, write_held_out_prompts
    from dflash.extract import run as extract
    from dflash.runtime.process import setup_logging
    from dflash.train import run as train
    from dflash.train.evaluate import run_eval
    from dflash.train.export import export_drafter

    setup_logging("INFO")
    src, work = Path(args.demo).resolve(), Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    summary = json.loads((src / "summary.json").read_text())
    cfg = DemoConfig.load(src / "demo-config.json")
    budget = demo.BUDGETS[cfg.budget]
    target, data = smollm2_folder(), src / DATA_FILE
    gpus = "0" if cfg.device == "cuda" else "cpu"
    lossless, store = src / "store", work / "store-fp8"
    run_dir, drafter_dir = work / "run-fp8", work / "drafter-fp8"
    seconds = {}

    t = time.perf_counter()
    extract(demo.extract_config(budget, target, data, store, gpus, codec="fp8"))
    seconds["extract"] = time.perf_counter() - t
    t = time.perf_counter()
    train(demo.train_config(budget, store, target, run_dir, gpus))
    seconds["train"] = time.perf_counter() - t
    export_drafter(str(run_dir), str(drafter_dir))

    def tau_hat(run: Path, on: Path) -> float:
        return run_eval(EvalConfig(drafter=str(run), store=str(on)))["tau_hat"]

    rows = 1 + budget.samples
    prompts = write_held_out_prompts(lossless, data, src / "run", budget.decode_prompts, rows,
                                     work / "decode-prompts.jsonl")
    t = time.perf_counter()
    dec = demo.decode_prompts(work / "decode-fp8.jsonl", run_dir, target, prompts, device=cfg.device,
                              max_new_tokens=budget.decode_tokens, numerics=demo.data_numerics(lossless))
    seconds["decode"] = time.perf_counter() - t

    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    arms = {
        "blosc": {"store_bytes": size(lossless), "tau_hat_on_lossless": tau_hat(src / "run", lossless),
                  "tau_hat_on_fp8": tau_hat(src / "run", store), "tau": summary["tau"],
                  "identical": summary["identical_prompts"]},
        "fp8": {"store_bytes": size(store), "tau_hat_on_lossless": tau_hat(run_dir, lossless),
                "tau_hat_on_fp8": tau_hat(run_dir, store), "tau": dec["tau"], "identical": dec["identical_prompts"]},
    }
    result = {"demo": str(src), "budget": cfg.budget, "device": cfg.device, "held_out_prompts_decoded": len(prompts),
              "arms": arms, "seconds": {k: round(v, 1) for k, v in seconds.items()},
              "ratio_tau_hat": arms["fp8"]["tau_hat_on_lossless"] / arms["blosc"]["tau_hat_on_lossless"],
              "ratio_tau": arms["fp8"]["tau"] / arms["blosc"]["tau"],
              "ratio_bytes": arms["fp8"]["store_bytes"] / arms["blosc"]["store_bytes"]}
    for name, a in arms.items():
        print(f"{name:5s}: store {a['store_bytes'] / 1e6:,.1f} MB, held-out tau_hat {a['tau_hat_on_lossless']:.3f} on "
              f"lossless features ({a['tau_hat_on_fp8']:.3f} on fp8), measured tau {a['tau']:.3f} over "
              f"{len(prompts)} prompts ({a['identical']} identical to greedy)")
    print(f"RESULT fp8 / blosc: store bytes {result['ratio_bytes']:.3f}, held-out tau_hat {result['ratio_tau_hat']:.3f}, "
          f"measured tau {result['ratio_tau']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
