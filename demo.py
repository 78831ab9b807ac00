"""`dflash demo`: the whole recipe on the embedded SmolLM2 target, ending in a measured acceptance length.

Stages: convert the target -> answer the bundled prompts with it -> extract the whole store -> train a small drafter
(some shards held out) -> tau_hat on the held-out shards -> export -> speculative decoding of the held-out prompts
against plain greedy decoding -> the final table (printed, and written as OUT/summary.json) and the training curve.
Every stage is resumable on its own (generate, extract and train resume themselves; decoding appends one line per
prompt), and OUT/demo-state.json records the finished stages, so a rerun after an interruption continues.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .atomic import write_atomic
from .errors import ConfigError

if TYPE_CHECKING:
    from .config import DemoConfig

__all__ = ["Budget", "BUDGETS", "run", "format_table"]

log = logging.getLogger(__name__)

STATE_FILE = "demo-state.json"
SUMMARY_FILE = "summary.json"
DECODE_FILE = "decode.jsonl"
DATA_FILE = "data.jsonl"
CURVE_FILE = "training-curve.png"
STAGES = ("generate", "extract", "train", "eval", "export", "decode")
# SmolLM2's tokenizer covers every embedding row, so the mask token must be a special token chat never uses:
# id 16 is <empty_output>, a code-data marker of its pre-training.
SMOLLM2_MASK_TOKEN = 16


@dataclass(frozen=True)
class Budget:
    """How much of each stage the demo runs: prompts and answer length, shards, drafter shape and steps, decoding."""

    prompts: int  # bundled prompts answered (the first N)
    gen_tokens: int  # answer length cap of `generate`
    gen_batch: int
    shard_prompts: int  # prompts per shard; the held-out split is by shard, so by prompt
    val_fraction: float
    draft_layers: int
    block_size: int
    steps: int
    batch_tokens: int
    anchors: int
    lr: float
    decode_prompts: int  # held-out prompts decoded speculatively and greedily
    decode_tokens: int
    samples: int = 0  # sampled answers per prompt besides the greedy one (more training data from the same prompts)
    sample_temperature: float = 0.8


BUDGETS = {
    # Sized for a 2-core CPU (about 20 minutes with set-up). The drafter's cost is the target's 49k-row lm_head on
    # every predicted slot, so on a CPU many small steps (block 4, 16 anchors per answer) learn more per second than
    # few large ones: measured on the SmolLM2 store, held-out tau_hat 1.06 after 150 steps of block 8 x 32 anchors,
    # 1.16 after 180 steps of this (same time). 1,500 steps would reach 1.31 (1.34 with 600 more, templated,
    # prompts: bench/prompt_diversity.py) at +5 minutes; far from 2.5 either way: the prompts bound it.
    "full": Budget(prompts=329, gen_tokens=128, gen_batch=32, shard_prompts=16, val_fraction=0.1, draft_layers=1,
                   block_size=4, steps=600, batch_tokens=1024, anchors=16, lr=3e-3, decode_prompts=8,
                   decode_tokens=128),
    # One GPU (sized for an H200, about 3 minutes): answers twice as long, one sampled answer per prompt besides
    # the greedy one (about 4x the CPU budget's tokens), a two-layer drafter with block 8. Measured on an H200 with
    # three sampled answers: held-out tau_hat peaked near 20 epochs and fell after (the drafter memorises the
    # ~300 training prompts), so the steps stop there.
    "gpu": Budget(prompts=329, gen_tokens=256, gen_batch=384, shard_prompts=16, val_fraction=0.1, draft_layers=2,
                  block_size=8, steps=200, batch_tokens=16384, anchors=64, lr=1e-3, decode_prompts=8,
                  decode_tokens=128, samples=1, sample_temperature=0.8),
    # The reduced budget of the slow test: every stage runs for real, on a handful of prompts.
    "tiny": Budget(prompts=20, gen_tokens=24, gen_batch=10, shard_prompts=5, val_fraction=0.25, draft_layers=1,
                   block_size=4, steps=6, batch_tokens=512, anchors=8, lr=2e-3, decode_prompts=2, decode_tokens=16,
                   samples=1),
}


def _cpu_seconds() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class _State:
    """The demo's record of finished stages (OUT/demo-state.json), rewritten atomically after each stage."""

    def __init__(self, out: Path, cfg: "DemoConfig") -> None:
        self.path = out / STATE_FILE
        self.data: dict[str, Any] = {"config": cfg.to_dict(), "stages": {}}
        if self.path.is_file():
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            if saved.get("config", {}).get("budget") != cfg.budget:
                raise ConfigError(
                    f"--out {out}: holds a demo run with --budget {saved.get('config', {}).get('budget')}, "
                    f"asked for --budget {cfg.budget}; rerun with the same budget or choose a new --out"
                )
            self.data["stages"] = saved.get("stages", {})

    def stage(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Return the stage's recorded result, or run it now, time it, and record it."""
        done = self.data["stages"].get(name)
        if done is not None:
            log.info("demo: %s already done (%.0f s); skipping", name, done["seconds"])
            return done
        log.info("demo: %s ...", name)
        t0, c0 = time.perf_counter(), _cpu_seconds()
        result = fn()
        result["seconds"] = round(time.perf_counter() - t0, 1)
        # CPU seconds of this process and its children: on a shared machine, wall time says little about speed.
        result["cpu_seconds"] = round(_cpu_seconds() - c0, 1)
        self.data["stages"][name] = result
        write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        log.info("demo: %s done in %.0f s", name, result["seconds"])
        return result


def _write_prompts(out: Path, n: int, *, repeat: int = 1, name: str = "prompts.jsonl") -> Path:
    """Return OUT/name: the first n bundled prompts, each `repeat` times in a row (rewritten only if different)."""
    from .assets import prompts_path

    lines = [ln for ln in prompts_path().read_text(encoding="utf-8").splitlines() if ln.strip()][:n]
    path = out / name
    text = "".join(ln + "\n" for ln in lines for _ in range(repeat))
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_atomic(path, text)
    return path


def _answers_by_row(path: Path, rows: int) -> list[str]:
    """Return the JSON line of each source row 0..rows-1 of a finished `generate` output (torn lines skipped)."""
    by_row: dict[int, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line torn by a killed run; its prompt was answered again further down
        by_row[int(rec["source_row"])] = json.dumps(rec, ensure_ascii=False)
    missing = [r for r in range(rows) if r not in by_row]
    if missing:
        raise ConfigError(f"{path}: expected answers to rows 0..{rows - 1}, rows {missing[:5]} are missing; "
                          "rerun `dflash demo` with the same --out to finish generating")
    return [by_row[r] for r in range(rows)]


def _write_data(out: Path, greedy: Path, sampled: Path | None, prompts: int, samples: int) -> Path:
    """Return OUT/data.jsonl: each prompt's greedy answer followed by its sampled ones, in prompt order.

    A prompt's rows are adjacent and a shard holds whole prompts, so a held-out shard holds every answer of its
    prompts: nothing of a held-out prompt is trained on.
    """
    lines = _answers_by_row(greedy, prompts)
    extra = _answers_by_row(sampled, prompts * samples) if sampled is not None and samples else []
    text = "".join(
        lines[i] + "\n" + "".join(extra[i * samples + j] + "\n" for j in range(samples if extra else 0))
        for i in range(prompts)
    )
    path = out / DATA_FILE
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_atomic(path, text)
    return path


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _decoded_rows(val_sample_ids: list[list[int]], rows_per_prompt: int, n: int) -> list[int]:
    """Return the data rows whose prompts are decoded: the greedy row of each held-out prompt, the first n."""
    rows = [int(r) for ids in val_sample_ids for r in ids if int(r) % rows_per_prompt == 0]
    return rows[:n]


def _held_out_prompts(store_dir: Path, data: Path, run_dir: Path, target: Path, n: int,
                      rows_per_prompt: int) -> list[list[int]]:
    """Return the token ids (chat template, generation prompt) of the first n prompts of the held-out shards."""
    from transformers import AutoTokenizer

    from .extract.data import read_rows
    from .storage import Store
    from .train.checkpoint import read_run_record

    store = Store.open(str(store_dir))
    val = read_run_record(run_dir)["resolved"]["val_shards"]
    rows = read_rows((str(data),))
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = []
    # A prompt's sampled answers follow its greedy one; it is decoded once.
    for row in _decoded_rows([store.read_shard(sid).sample_ids.tolist() for sid in val], rows_per_prompt, n):
        messages = rows[row].messages[:-1]  # drop the target's own answer: it is what we decode
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts


def _decode(out: Path, cfg: "DemoConfig", budget: Budget, prompts: list[list[int]], target_dir: Path) -> dict:
    """Return the summary of speculative vs greedy decoding of the prompts, resuming from OUT/decode.jsonl."""
    import torch

    from .drafter.decode import compare_one, drafter_proposer, load_target, summarize
    from .train.checkpoint import open_drafter

    device = "cuda" if cfg.device == "cuda" else "cpu"
    # fp32 both ways: greedy ties then break the same in a one-token step and in a block verification.
    target = load_target(target_dir, device=device, dtype=torch.float32)
    drafter = open_drafter(out / "drafter", device=device, dtype=torch.float32)
    stops = sorted({int(t) for t in [target.generation_config.eos_token_id] if t is not None}
                   if not isinstance(target.generation_config.eos_token_id, list)
                   else set(target.generation_config.eos_token_id))
    path = out / DECODE_FILE
    rows = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()] if path.is_file() else []
    rows = rows[: len(prompts)]
    propose = drafter_proposer(drafter, target)
    with open(path, "a", encoding="utf-8") as f:
        for i in range(len(rows), len(prompts)):
            row = compare_one(target, propose, prompts[i], block_size=drafter.config.block_size,
                              layer_ids=drafter.config.target_layer_ids, max_new_tokens=budget.decode_tokens,
                              stop_ids=stops, parity=True)
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            log.info("decode %d/%d: %d tokens, tau %.2f, %s greedy", i + 1, len(prompts), row["tokens"], row["tau"],
                     "same as" if row["identical"] else "DIFFERENT from")
    return summarize(rows)


def run(cfg: "DemoConfig") -> dict[str, Any]:
    """Return the final table (also printed and written to OUT/summary.json) after running every stage left."""
    from .assets import smollm2_folder
    from .config import ExtractConfig, GenerateConfig, TrainConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    budget = BUDGETS[cfg.budget]
    out = Path(cfg.out).resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: expected a folder for the demo's outputs, found a file; pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    state = _State(out, cfg)
    cfg.save(out / "demo-config.json")
    started = time.perf_counter()
    gpus = "0" if cfg.device == "cuda" else "cpu"
    target = smollm2_folder()
    answers, sampled, data = out / "answers.jsonl", out / "answers-sampled.jsonl", out / DATA_FILE
    store_dir, run_dir, drafter_dir = out / "store", out / "run", out / "drafter"
    rows_per_prompt = 1 + budget.samples

    def generate() -> dict[str, Any]:
        from .generate import run as gen

        def answer(prompts: Path, into: Path, temperature: float):
            return gen(GenerateConfig(model=str(target), prompts=str(prompts), out=str(into), temperature=temperature,
                                      max_new_tokens=budget.gen_tokens, batch_size=budget.gen_batch,
                                      device=cfg.device))

        r = answer(_write_prompts(out, budget.prompts), answers, 0.0)
        result = {"prompts": r.prompts, "answered_now": r.answered, "new_tokens": r.new_tokens}
        if budget.samples:
            many = _write_prompts(out, budget.prompts, repeat=budget.samples, name="prompts-sampled.jsonl")
            s = answer(many, sampled, budget.sample_temperature)
            result.update(sampled_answers=s.prompts, sampled_new_tokens=s.new_tokens)
        _write_data(out, answers, sampled, r.prompts, budget.samples)
        return result

    def extract() -> dict[str, Any]:
        from .extract import run as ext

        s = ext(ExtractConfig(model=str(target), data=(str(data),), out=str(store_dir), gpus=gpus,
                              shard_size=budget.shard_prompts * rows_per_prompt, max_length=1024, batch_tokens=8192, min_loss_tokens=4,
                              mask_token_id=SMOLLM2_MASK_TOKEN, dtype="float32"))
        return {"samples": s["samples"], "tokens": s["tokens"], "bytes": _dir_bytes(store_dir)}

    def train() -> dict[str, Any]:
        from .train import run as tr
        from .train.metrics import read_metrics

        tr(TrainConfig(store=str(store_dir), target=str(target), out=str(run_dir), gpus=gpus, epochs=1000,
                       max_steps=budget.steps, batch_tokens=budget.batch_tokens, lr=budget.lr,
                       draft_layers=budget.draft_layers, block_size=budget.block_size, anchors=budget.anchors,
                       val_fraction=budget.val_fraction, resume=True, save_every=max(1, budget.steps // 6),
                       log_every=max(1, budget.steps // 30), dtype="bfloat16", warmup_ratio=0.04))
        vals = [m for m in read_metrics(run_dir) if m.get("split") == "val"]
        return {"steps": budget.steps, "val_tau_hat": vals[-1]["tau_hat"] if vals else None}

    def evaluate() -> dict[str, Any]:
        from .config import EvalConfig
        from .train.evaluate import run_eval

        r = run_eval(EvalConfig(drafter=str(run_dir), store=str(store_dir)))
        return {k: r[k] for k in ("tau_hat", "loss", "acc", "slot_accuracy", "accept_rate", "blocks", "tokens",
                                  "shards", "tokens_trained_on", "held_out_samples")}

    def export() -> dict[str, Any]:
        from .train.export import export_drafter

        export_drafter(str(run_dir), str(drafter_dir))
        return {"path": str(drafter_dir), "bytes": _dir_bytes(drafter_dir)}

    def decode() -> dict[str, Any]:
        prompts = _held_out_prompts(store_dir, data, run_dir, target, budget.decode_prompts, rows_per_prompt)
        return _decode(out, cfg, budget, prompts, target)

    gen_r = state.stage("generate", generate)
    ext_r = state.stage("extract", extract)
    tr_r = state.stage("train", train)
    ev_r = state.stage("eval", evaluate)
    state.stage("export", export)
    dec_r = state.stage("decode", decode)
    curve = run_dir / "curves.png"
    if curve.is_file():
        shutil.copyfile(curve, out / CURVE_FILE)
    table = {
        "target": "SmolLM2-135M-Instruct (embedded)",
        "device": cfg.device,
        "budget": cfg.budget,
        "prompts_answered": gen_r["prompts"],
        "tokens_extracted": ext_r["tokens"],
        "store_bytes": ext_r["bytes"],
        "training_seconds": tr_r["seconds"],
        "training_steps": tr_r["steps"],
        "drafter": f"{budget.draft_layers} layers, block {budget.block_size}",
        "tokens_trained_on": ev_r.get("tokens_trained_on"),
        "held_out_prompts": (ev_r["held_out_samples"] // rows_per_prompt) if "held_out_samples" in ev_r else None,
        "tau_hat": round(ev_r["tau_hat"], 3),
        "slot_accuracy": [round(a, 3) for a in ev_r.get("slot_accuracy", [])],
        "tau": round(dec_r["tau"], 3),
        # Teacher-forced over the decoded answers: at the anchors decoding used, and at every anchor (eval's way).
        "tau_hat_decoded_same_anchors": _rounded(dec_r.get("tau_hat_same_anchors")),
        "tau_hat_decoded_every_anchor": _rounded(dec_r.get("tau_hat_every_anchor")),
        "parity_blocks_differ": dec_r.get("blocks_differ"),
        "held_out_prompts_decoded": dec_r["prompts"],
        "speedup_target_forwards": round(dec_r["speedup_forwards"], 3),
        "forwards_greedy": dec_r["forwards_greedy"],
        "forwards_speculative": dec_r["forwards_speculative"],
        "speedup_wall_clock": round(dec_r["seconds_greedy"] / dec_r["seconds_speculative"], 3)
        if dec_r["seconds_speculative"] else None,
        "seconds_greedy": round(dec_r["seconds_greedy"], 1),
        "seconds_speculative": round(dec_r["seconds_speculative"], 1),
        "identical_to_greedy": bool(dec_r["identical"]),
        "identical_prompts": dec_r["identical_prompts"],
        "stage_seconds": {k: state.data["stages"][k]["seconds"] for k in STAGES},
        "this_run_seconds": round(time.perf_counter() - started, 1),
        "training_curve": str(out / CURVE_FILE) if (out / CURVE_FILE).is_file() else None,
        "drafter_folder": str(drafter_dir),
        "summary": str(out / SUMMARY_FILE),
    }
    write_atomic(out / SUMMARY_FILE, json.dumps(table, indent=2) + "\n")
    return table


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _wall_clock(t: dict[str, Any]) -> str:
    """Return the wall-clock speed-up said plainly: faster or slower, and why slower where it is."""
    w = t.get("speedup_wall_clock")
    if w is None:
        return "not timed"
    times = f"{w:.2f}x ({t['seconds_greedy']:.1f} s greedy -> {t['seconds_speculative']:.1f} s)"
    if w >= 1:
        return f"{times}, faster"
    why = ("on a CPU the drafter's forwards cost more than the target forwards they save" if t["device"] == "cpu"
           else "the drafter's forwards cost more than the target forwards they save")
    return f"{times}, slower: {why}"


def format_table(t: dict[str, Any]) -> str:
    """Return the final table as aligned text lines."""
    held = f", {t['held_out_prompts']} prompts held out" if t.get("held_out_prompts") is not None else ""
    trained = f", trained on {t['tokens_trained_on']:,} tokens" if t.get("tokens_trained_on") is not None else ""
    same = t.get("tau_hat_decoded_same_anchors")
    rows = [
        ("target", f"{t['target']} on {t['device']}"),
        ("tokens extracted", f"{t['tokens_extracted']:,} ({t['prompts_answered']} prompts answered{held})"),
        ("store size", f"{t['store_bytes'] / 1e6:.1f} MB"),
        ("training time", f"{t['training_seconds']:.0f} s ({t['training_steps']} steps, drafter {t['drafter']}"
                          f"{trained})"),
        ("tau_hat (held-out, teacher-forced)", f"{t['tau_hat']:.2f}"),
        ("per-slot accuracy (held-out)", " ".join(f"{a:.3f}" for a in t.get("slot_accuracy", [])) or "-"),
        ("tau (measured, held-out prompts)", f"{t['tau']:.2f} over {t['held_out_prompts_decoded']} prompts"),
    ]
    if same is not None:
        rows.append(("tau_hat on the decoded answers", f"{same:.2f} at the anchors decoding used, "
                                                       f"{t['tau_hat_decoded_every_anchor']:.2f} at every anchor"))
    rows += [
        ("speed-up in target forwards", f"{t['speedup_target_forwards']:.2f}x "
                                        f"({t['forwards_greedy']} greedy -> {t['forwards_speculative']})"),
        ("speed-up in wall clock", _wall_clock(t)),
        ("output identical to greedy", f"{'yes' if t['identical_to_greedy'] else 'no'} "
                                       f"({t['identical_prompts']}/{t['held_out_prompts_decoded']} prompts)"),
        ("stage seconds", ", ".join(f"{k} {v:.0f}" for k, v in t["stage_seconds"].items())),
    ]
    rows += [(name, t[key]) for name, key in (("drafter folder", "drafter_folder"), ("training curve", "training_curve"),
                                              ("this table", "summary")) if t.get(key)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
