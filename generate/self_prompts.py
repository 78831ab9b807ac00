"""`dflash generate --self-prompts N`: prompts the target writes itself (Magpie), distinct, finished, resumable.

The chat template is rendered up to where the user's text would start (its system turn, if it adds one, and the
user-turn header); the target continues from there, and what it writes until its end-of-turn token is a user
prompt in its own distribution. Draw d is the d-th continuation, sampled at temperature 1 from a stream keyed by
(--seed, d) (engine.py), so it does not depend on the batch it ran in, and draws are judged in order of d:

- finished: it ended with an end-of-turn/eos token within MAX_PROMPT_TOKENS (not cut at the limit);
- non-trivial: at least MIN_WORDS words and MIN_CHARS characters;
- distinct: its normalised text (case-folded, whitespace collapsed) is not in --exclude, in --out, or earlier.

Accepted prompts are appended as {"prompt": text, "draw": d} lines (`--prompts` reads the prompt and ignores the
draw), so a rerun repairs a torn tail, reads the prompts and the last draw, and continues with draw d + 1.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..runtime.atomic import append_lines, repair_torn_tail
from ..errors import ConfigError, InputError
from ..runtime.process import Progress
from ..targets.load import load_for_chat
from .model import NUMERICS, check_identity, resolve
from .prompts import read_prompts, written_lines

if TYPE_CHECKING:
    from ..config import GenerateConfig

__all__ = ["MAX_PROMPT_TOKENS", "MIN_WORDS", "MIN_CHARS", "normalise", "prefix_ids", "read_written", "run"]

log = logging.getLogger(__name__)

TEMPERATURE = 1.0  # Magpie samples the user turn from the model's own distribution
MAX_PROMPT_TOKENS = 128
MIN_WORDS, MIN_CHARS = 3, 12
# Draws tried at most (a function of N, so a rerun stops where the first run would have): a target that rarely
# finishes a prompt ends with fewer than N and a warning instead of running forever.
MAX_DRAWS_PER_PROMPT, MAX_DRAWS_EXTRA = 20, 1000
_MARK = "\u2063PROMPT\u2063"  # a string no template holds: where the user's text would start
# The options that decide which prompts are written; N is not one (a rerun with a larger N continues).
_IDENTITY_FIELDS = ("model", "seed", "exclude") + NUMERICS


def normalise(text: str) -> str:
    """Return the text two prompts are compared by: case-folded, whitespace collapsed."""
    return " ".join(text.casefold().split())


def _trivial(text: str) -> bool:
    return len(text.split()) < MIN_WORDS or len(text) < MIN_CHARS


def prefix_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Return the token ids of the template up to the user's text, and the special token that ends a user turn
    (empty when the template's end of turn is not one special token)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    head, tail = text.split(_MARK, 1)
    ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    after = tokenizer(tail, add_special_tokens=False)["input_ids"]
    end = after[:1] if after and after[0] in set(tokenizer.all_special_ids) else []
    return ids, end


def read_written(out: Path) -> tuple[list[str], int]:
    """Return the prompts already in `out` and the draw to continue from, after cutting a torn last line."""
    if not out.exists():
        return [], 0
    torn = repair_torn_tail(out)
    if torn:
        log.warning("%s: dropped a torn last line of %d bytes (an interrupted write)", out, torn)
    prompts, next_draw = [], 0
    for lineno, raw in written_lines(out):
        try:
            rec = json.loads(raw)
            text, draw = rec["prompt"], rec["draw"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(
                f"--out {out} line {lineno}: expected a {{prompt, draw}} line written by `dflash generate "
                f"--self-prompts`, found {raw[:60]!r}; move the file away or pass a new --out"
            ) from None
        prompts.append(text)
        next_draw = max(next_draw, int(draw) + 1)
    return prompts, next_draw


def _excluded(paths: tuple[str, ...]) -> set[str]:
    """Return the normalised user turns of the --exclude prompt files."""
    seen: set[str] = set()
    for path in paths:
        for p in read_prompts(path):
            seen.update(normalise(m["content"]) for m in p.messages if m["role"] == "user")
    return seen


def run(cfg: "GenerateConfig") -> Any:
    """Return the GenerateResult of writing prompts into cfg.out until it holds cfg.self_prompts of them."""
    from .answer import GenerateResult
    from .engine import FastDecoder, Request

    out = Path(cfg.out)
    want = cfg.self_prompts
    seen = _excluded(cfg.exclude)
    cfg = resolve(cfg)
    if cfg.engine != "fast":
        raise ConfigError(f"--self-prompts runs on the fast engine only (this run resolved --engine {cfg.engine}); "
                          "rerun with --engine fast")
    out.parent.mkdir(parents=True, exist_ok=True)
    check_identity(cfg, out, _IDENTITY_FIELDS)
    written, draw = read_written(out)
    seen.update(normalise(p) for p in written)
    have = len(written)
    log.info("self-prompts: %d of %d in %s, continuing from draw %d", have, want, out, draw)
    if have >= want:
        return GenerateResult(want, 0, have, 0, 0.0)
    target = load_for_chat(cfg.model, cfg.device, cfg.dtype)
    prefix, end = prefix_ids(target.tokenizer)
    decoder = FastDecoder(target.model, slots=cfg.batch_size, max_new_tokens=MAX_PROMPT_TOKENS,
                          stop_ids=target.stop_ids + end, temperature=TEMPERATURE, seed=cfg.seed)
    last_draw = MAX_DRAWS_PER_PROMPT * want + MAX_DRAWS_EXTRA
    requests: Iterator[Request] = (Request(d, prefix) for d in range(draw, last_draw))
    progress = Progress(want, unit="prompt", desc="self-prompts", initial=have, every_s=30.0, logger=log)
    start, tokens, judged = time.perf_counter(), 0, {}
    try:
        for done in decoder.run(requests, max_prompt=len(prefix)):
            for c in done:
                judged[c.key] = c
                tokens += len(c.tokens)
            lines = []
            # Judge draws in order, so which prompts are kept does not depend on which finished first.
            while draw in judged and have + len(lines) < want:
                c = judged.pop(draw)
                text = target.tokenizer.decode(c.tokens, skip_special_tokens=True).strip()
                if c.finished and not _trivial(text) and normalise(text) not in seen:
                    seen.add(normalise(text))
                    lines.append(json.dumps({"prompt": text, "draw": draw}, ensure_ascii=False))
                draw += 1
            append_lines(out, lines)
            have += len(lines)
            progress.update(len(lines), detail=f"{draw:,} draws")
            if have >= want:
                break
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    if have < want:
        log.warning("self-prompts: only %d of %d distinct finished prompts after %d draws; %s holds them",
                    have, want, last_draw, out)
    log.info("self-prompts: %d prompts in %s (%d draws, %.0f s)", have, out, draw, seconds)
    return GenerateResult(want, have - len(written), len(written), tokens, seconds)
