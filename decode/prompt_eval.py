"""`dflash eval --prompts FILE`: measured tau of a drafter by real speculative decoding on any prompt file (HumanEval,
MT-Bench, gsm8k, your own), beside plain greedy decoding, with tau_hat at the anchors the decoding used.

Prompts are read as every stage reads conversation files (chatfiles), rendered with the target's chat template (and
--chat-template-kwargs) up to the last user turn, and decoded greedily in float32 both ways, so a greedy tie breaks
the same in a one-token step and in a block verification. One JSON line per decoded prompt goes to --out (when
given), so a rerun resumes.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime.atomic import append_lines, repair_torn_tail
from ..conversations import BadRowLog, jsonl_lines, read_rows, report_bad_rows
from ..errors import InputError

if TYPE_CHECKING:
    from ..config import EvalConfig

__all__ = ["prompt_ids", "run_prompt_eval", "decode_prompt_file", "format_prompt_eval", "tree_line"]

log = logging.getLogger(__name__)


def _until_last_user(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Return the turns up to the last user (or tool) turn: what the target answers next."""
    last = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
    return messages[: last + 1]


def prompt_ids(path: str, tokenizer: Any, *, limit: int | None = None,
               template_kwargs: dict[str, Any] | None = None, flag: str = "--prompts") -> list[list[int]]:
    """Return the token ids (chat template with the generation prompt) of the usable prompts of a file, the first
    `limit`; the unusable rows are counted by reason and named; InputError if none is usable."""
    rows = read_rows((path,), flag=flag, need="user")
    bad, out = BadRowLog(), []
    for r in rows:
        if limit is not None and len(out) >= limit:
            break
        if r.error:
            bad.add(r.error, r.index, r.where, r.detail)
            continue
        ids = tokenizer.apply_chat_template(_until_last_user(r.messages), add_generation_prompt=True, tokenize=True,
                                            **(template_kwargs or {}))
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    report_bad_rows(bad, "prompt rows")
    if not out:
        raise InputError(f"{flag} {path}: expected at least one row with a user turn, found none usable of "
                         f"{len(rows):,} ({bad.summary()}); fix the file")
    return out


def _stop_ids(target: Any) -> list[int]:
    eos = target.generation_config.eos_token_id
    return sorted({int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None})


def run_prompt_eval(cfg: "EvalConfig", folder: Path, record: dict[str, Any] | None) -> dict[str, Any]:
    """Return the summary of speculative against greedy decoding of the prompts (decode_prompt_file's).

    folder, record: the drafter's folder and its run record (or None), as drafter.folders.resolve_drafter gives
    them for cfg.drafter: the caller resolves, since decode/ knows no checkpoint format."""
    import torch

    target_dir = cfg.target or (record or {}).get("config", {}).get("target")
    if not target_dir:
        raise InputError(f"--drafter {cfg.drafter}: an export does not say which target it drafts for; pass "
                         "--target DIR (the target's Hugging Face folder)")
    return decode_prompt_file(cfg.prompts, folder, target_dir, device="cuda" if torch.cuda.is_available() else "cpu",
                              max_new_tokens=cfg.decode, limit=cfg.max_prompts,
                              out=Path(cfg.out) if cfg.out else None, tree_budgets=cfg.tree_budget or (),
                              template_kwargs=cfg.chat_template_kwargs)


def decode_prompt_file(prompts_file: str, folder: Path, target_dir: str | Path, *, device: str, max_new_tokens: int,
                       limit: int | None = None, out: Path | None = None, tree_budgets: tuple[int, ...] = (),
                       template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the summary of speculative against greedy decoding of a prompt file's prompts (speculative.summarize's
    keys, plus the drafter, prompts file, device and seconds): `dflash eval --prompts` and the demo's decode stages
    both come here, so one run and one prompt file give one tau whoever asks.

    out: a JSONL of one row per decoded prompt; a rerun resumes after its rows."""
    import torch
    from transformers import AutoTokenizer

    from .drafting import drafter_proposer
    from .speculative import compare_one, load_target, static_decoder, summarize
    from .static_tree import tree_decoders
    from ..runtime.process import Progress
    from ..drafter.files import load_drafter

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = prompt_ids(prompts_file, tokenizer, limit=limit, template_kwargs=template_kwargs)
    rows: list[dict[str, Any]] = []
    if out is not None and out.is_file():
        repair_torn_tail(out)  # a line cut by a kill: that prompt is decoded again
        rows = [json.loads(raw) for _, _, raw in jsonl_lines(out) if raw.strip()][: len(prompts)]
        log.info("eval: %d of %d prompts already decoded in %s", len(rows), len(prompts), out)
    # float32 both ways: greedy ties then break the same in a one-token step and in a block verification.
    target = load_target(str(target_dir), device=device, dtype=torch.float32)
    drafter = load_drafter(folder, device=device, dtype=torch.float32).eval()
    propose, stops = drafter_proposer(drafter, target), _stop_ids(target)
    decoder = static_decoder(target, drafter, prompts[len(rows):], max_new_tokens=max_new_tokens)
    trees = tree_decoders(target, drafter, tree_budgets, prompts[len(rows):], max_new_tokens=max_new_tokens)
    progress = Progress(len(prompts), unit="prompt", desc="eval decode", initial=len(rows), every_s=30.0,
                        logger=log)
    t0 = time.perf_counter()
    try:
        for ids in prompts[len(rows):]:
            row = compare_one(target, propose, ids, block_size=drafter.config.block_size,
                              layer_ids=drafter.config.target_layer_ids, max_new_tokens=max_new_tokens,
                              stop_ids=stops, parity=True, decoder=decoder, trees=trees)
            rows.append(row)
            if out is not None:
                append_lines(out, [json.dumps(row)])
            progress.update(1, detail=f"tau {summarize(rows)['tau']:.2f}")
    finally:
        progress.close()
    result = summarize(rows)
    result.update(drafter=str(folder), prompts_file=str(prompts_file), max_new_tokens=max_new_tokens, device=device,
                  seconds=round(time.perf_counter() - t0, 1))
    return result


def format_prompt_eval(r: dict[str, Any]) -> str:
    """Return the human-readable summary of run_prompt_eval's result."""
    lines = [
        f"drafter     {r['drafter']}",
        f"prompts     {r['prompts_file']} ({r['prompts']} prompts, up to {r['max_new_tokens']} new tokens each, "
        f"{r['device']})",
        f"tau         {r['tau']:.3f} (measured: speculative decoding, greedy, float32)",
    ]
    if "tau_hat_same_anchors" in r:
        lines.append(f"tau_hat     {r['tau_hat_same_anchors']:.3f} at the anchors decoding used, "
                     f"{r['tau_hat_every_anchor']:.3f} at every anchor (teacher-forced on the decoded answers)")
    lines += [
        f"forwards    {r['forwards_greedy']} greedy -> {r['forwards_speculative']} speculative "
        f"({r['speedup_forwards']:.2f}x)",
        f"wall clock  {r['seconds_greedy']:.1f} s greedy -> {r['seconds_speculative']:.1f} s speculative "
        f"({r['speedup_wall_clock']:.2f}x)",
        f"tokens/s    {r.get('tokens_per_s_greedy', 0):.0f} greedy, {r.get('tokens_per_s_speculative', 0):.0f} "
        f"speculative ({r.get('engine', 'dynamic')} decoding)",
        f"identical   {'yes' if r['identical'] else 'NO'} ({r['identical_prompts']}/{r['prompts']} prompts equal "
        "plain greedy)",
    ]
    lines += [tree_line(n, t) for n, t in (r.get("trees") or {}).items()]
    return "\n".join(lines)


def tree_line(budget: str, t: dict[str, Any]) -> str:
    """Return one line of a tree budget's results (summarize's trees[budget])."""
    return (f"tree N={budget:<4} tau {t['tau']:.3f}, forwards {t['forwards']} ({t['speedup_forwards']:.2f}x fewer "
            f"than greedy), {t['seconds']:.1f} s ({t['speedup_wall_clock']:.2f}x greedy, {t['speedup_vs_path']:.2f}x "
            f"the path), {'identical to greedy' if t['identical'] else 'NOT identical to greedy'}")
