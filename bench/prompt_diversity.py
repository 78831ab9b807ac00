"""Does prompt diversity lift held-out tau_hat? Same drafter, same steps, with and without extra prompts.

Takes a finished CPU demo folder (`dflash demo`, budget full) and, side by side in one run:
  arm A: the demo's training rows only (its held-out shards removed);
  arm B: the same rows plus the target's greedy answers to N templated prompts (instruction templates x topics,
         written here, none of them a bundled prompt);
each extracted, trained with the demo's drafter settings for --steps steps, and scored on the demo's held-out
shards (teacher-forced tau_hat, the demo's eval settings). Prints both tau_hat and their ratio.

    python3 bench/prompt_diversity.py --demo dflash-demo --extra 600 --steps 1500    # ~30 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

TOPICS = (
    "photosynthesis|the water cycle|black holes|the French Revolution|machine learning|the immune system|volcanoes|"
    "the stock market|climate change|the Roman Empire|DNA|electric cars|the internet|coffee|honeybees|"
    "the moon landing|renewable energy|the human brain|earthquakes|vaccines|the Great Wall of China|inflation|"
    "recycling|the solar system|chess|the Olympic Games|plate tectonics|antibiotics|the printing press|rainforests|"
    "cryptocurrency|jazz music|the Industrial Revolution|sleep|the ocean tides|gravity|democracy|volunteering|"
    "the Renaissance|bread baking|time management|the Amazon river|nuclear power|social media|"
    "the Pyramids of Giza|meditation|hurricanes|public libraries|the periodic table|marathon running|penguins|"
    "the Silk Road|wind turbines|the heart|origami|glaciers|the Moon|electricity|bicycles|ancient Greece|tea|fungi|"
    "rainbows|the printing of money|robots"
).split("|")
TEMPLATES = (
    "Explain {t} in simple terms.|Write a short paragraph about {t}.|What are three interesting facts about {t}?|"
    "Why is {t} important?|Give me a brief history of {t}.|How would you explain {t} to a ten-year-old?|"
    "What are the main advantages and disadvantages of {t}?|Write a short poem about {t}.|"
    "Summarize what scientists know about {t}.|What is a common misconception about {t}?|"
    "List five questions a student might ask about {t}.|Describe {t} in three sentences.|"
    "How does {t} affect everyday life?|Write a haiku about {t}.|What should a beginner know about {t}?|"
    "Compare {t} with something similar and explain the differences.|Tell me a fun story involving {t}.|"
    "What careers are related to {t}?|Write a short quiz with answers about {t}.|What is the future of {t}?"
).split("|")


def templated_prompts(n: int, seed: int = 0) -> list[str]:
    """Return n prompts of TEMPLATES x TOPICS (1,300 in all) in a fixed shuffled order."""
    rows = [tp.format(t=t) for tp in TEMPLATES for t in TOPICS]
    random.Random(seed).shuffle(rows)
    return rows[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", default="dflash-demo", help="a finished `dflash demo` folder (budget full)")
    ap.add_argument("--extra", type=int, default=600, help="templated prompts added in arm B (at most 1,300)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--work", default="/tmp/dflash-prompt-diversity")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from dflash import demo
    from dflash.demo.assets import smollm2_folder
    from dflash.demo.data import DATA_FILE
    from dflash.config import ExtractConfig, GenerateConfig, TrainConfig
    from dflash.extract import run as extract
    from dflash.generate.answer import run as generate
    from dflash.extract.plan import shard_ranges
    from dflash.storage import Store
    from dflash.train import run as train
    from dflash.drafter.folders import read_run_record
    from dflash.train.evaluate import evaluate_shards
    from dflash.drafter.files import load_drafter
    from dflash.drafter.folders import find_checkpoint
    from dflash.targets.head import load_target_head

    base, work = Path(args.demo), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    budget, target = demo.BUDGETS["full"], str(smollm2_folder())
    record = read_run_record(base / "run")
    val = record["resolved"]["val_shards"]
    lines = (base / DATA_FILE).read_text(encoding="utf-8").splitlines()
    ranges = shard_ranges(len(lines), budget.shard_prompts)
    held = {r for s in val for r in range(*ranges[s])}
    train_rows = [ln for i, ln in enumerate(lines) if i not in held]

    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in templated_prompts(args.extra)))
    answers = work / "answers.jsonl"
    t = time.perf_counter()
    generate(GenerateConfig(model=target, prompts=str(prompts), out=str(answers), max_new_tokens=budget.gen_tokens,
                            batch_size=budget.gen_batch, device="cpu"))
    print(f"generate: {args.extra} templated prompts answered in {time.perf_counter() - t:.0f} s", flush=True)
    new = sorted((json.loads(ln) for ln in answers.read_text(encoding="utf-8").splitlines() if ln.strip()),
                 key=lambda r: r["source_row"])

    head = load_target_head(target, dtype=torch.float32, device=torch.device("cpu"))
    held_out = Store.open(str(base / "store"))
    result = {}
    for arm, extra in (("A", []), ("B", new)):
        data = work / f"data-{arm}.jsonl"
        data.write_text("".join(ln + "\n" for ln in train_rows) + "".join(json.dumps(r) + "\n" for r in extra))
        store, run = work / f"store-{arm}", work / f"run-{arm}"
        s = extract(ExtractConfig(model=target, data=(str(data),), out=str(store), gpus="cpu",
                                  shard_size=budget.shard_prompts, max_length=1024, batch_tokens=8192,
                                  min_loss_tokens=4, mask_token_id=demo.SMOLLM2_MASK_TOKEN, dtype="float32"))
        shutil.rmtree(run, ignore_errors=True)
        t = time.perf_counter()
        train(TrainConfig(store=str(store), target=target, out=str(run), gpus="cpu", epochs=1000,
                          max_steps=args.steps, batch_tokens=budget.batch_tokens, lr=budget.lr,
                          draft_layers=budget.draft_layers, block_size=budget.block_size, anchors=budget.anchors,
                          val_fraction=0.0, save_every=args.steps, log_every=50, dtype="bfloat16",
                          warmup_ratio=0.04))
        seconds = time.perf_counter() - t
        model = load_drafter(find_checkpoint(run), dtype=torch.float32)
        out = evaluate_shards(model, head, held_out, val, batch_tokens=budget.batch_tokens, anchors=budget.anchors,
                              device="cpu", attention="sdpa")
        result[arm] = {"rows": len(train_rows) + len(extra), "tokens": s["tokens"], "train_s": round(seconds),
                       "tau_hat": out["tau_hat"], "loss": out["loss"], "slot_accuracy": out["slot_accuracy"]}
        print(f"arm {arm}: {result[arm]['rows']} rows, {s['tokens']:,} tokens, {args.steps} steps in {seconds:.0f} s: "
              f"held-out tau_hat {out['tau_hat']:.3f}, loss {out['loss']:.3f}, "
              f"slot accuracy {[round(x, 3) for x in out['slot_accuracy']]}", flush=True)
    ratio = result["B"]["tau_hat"] / result["A"]["tau_hat"]
    print(f"RESULT held-out tau_hat with {args.extra} templated prompts / without: "
          f"{result['B']['tau_hat']:.3f} / {result['A']['tau_hat']:.3f} = {ratio:.3f}", flush=True)
    (work / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
