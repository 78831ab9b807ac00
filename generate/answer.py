"""`dflash generate`: answer prompts with the target through its chat template, appending resumable JSONL records.

DFlash drafters learn the target's own continuations, so the recipe regenerates the answers of a prompt set with
the target before extraction: every assistant turn of a conversation, in order, each given the regenerated history
(prompts.py says why). Each output line is `{"messages": [..., {"role": "assistant", ...}], "source_row": i, ...}`,
ready for `dflash extract --data`. Conversations are answered in chunks, turn by turn across the chunk, and a
record is appended (and fsynced, in groups) when its last turn is answered; a rerun reads what is there, drops a
torn last line left by a kill, and answers only the rows that have no record yet (a kill loses at most the
conversations of the chunk still in progress). With --server, OpenAI-compatible servers answer instead (remote.py):
the same records, each conversation appended once its last turn is answered.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime.atomic import append_lines, repair_torn_tail
from ..conversations import prompt_turns
from ..errors import InputError
from ..runtime.process import Progress as Display
from ..targets.load import Loaded, load_for_chat
from .client import Servers
from .model import NUMERICS, check_identity, resolve
from .prompts import Conversation, Prompt, read_prompts, written_lines
from .remote import regenerate

if TYPE_CHECKING:
    from ..config import GenerateConfig

__all__ = ["GenerateResult", "read_done", "run"]

log = logging.getLogger(__name__)

# The options that decide what an answer is (numerics included, or the served model and its sampling); a rerun into
# the same --out must keep them.
_IDENTITY_FIELDS = ("model", "served_model", "max_new_tokens", "temperature", "seed", "chat_template_kwargs")
_IN_PROCESS = _IDENTITY_FIELDS + NUMERICS
_SERVED = _IDENTITY_FIELDS + ("top_p", "top_k", "sampling_mix")
_LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class GenerateResult:
    """What a `generate` run did: rows in the file, rows answered now and before, tokens produced, seconds spent."""

    prompts: int
    answered: int
    skipped: int
    new_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Return the generated tokens per second of this run (0 when nothing ran)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def read_done(out: Path, prompts: list[Prompt]) -> set[int]:
    """Return the source rows already answered in `out`, after cutting off a torn last line left by a kill.

    Every record is written with its trailing newline, so a last line without one was interrupted mid-write; it is
    dropped even when it happens to parse. A bad line before the last one is real damage and is reported.
    """
    if not out.exists():
        return set()
    torn = repair_torn_tail(out)
    if torn:
        log.warning("%s: dropped a torn last line of %d bytes (an interrupted write)", out, torn)
    by_row = {p.row: p for p in prompts}
    done: set[int] = set()
    for lineno, raw in written_lines(out):
        try:
            rec = json.loads(raw)
            row = rec["source_row"]
            messages = rec["messages"]
            kept = prompt_turns(messages)
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(
                f"--out {out} line {lineno}: expected a record written by `dflash generate`, found {raw[:60]!r}; "
                "move the file away or pass a new --out"
            ) from None
        if not isinstance(row, int) or row not in by_row or kept != by_row[row].messages:
            raise InputError(
                f"--out {out} line {lineno}: source_row {row!r} does not answer that row of the prompts file "
                "(the prompts changed since it was written); pass a new --out or the original --prompts"
            )
        done.add(row)
    return done


class _Progress:
    """Prompts answered and tokens/s, shown with rate and ETA (see runtime.process.Progress)."""

    def __init__(self, total: int) -> None:
        self.tokens = 0
        self.start = time.perf_counter()
        self.display = Display(total, unit="prompt", desc="generate", every_s=_LOG_EVERY_S, logger=log)

    def update(self, prompts: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.display.update(prompts, detail=f"{self.tokens:,} tokens, {rate:,.1f} tok/s")

    def close(self) -> None:
        self.display.close()


def _append(out: Path, records: list[dict[str, Any]]) -> None:
    """Append records as JSON lines and fsync, so a batch is either on disk whole or ends in a torn last line."""
    append_lines(out, (json.dumps(r, ensure_ascii=False) for r in records))


def run(cfg: "GenerateConfig") -> GenerateResult:
    """Return what was done after answering every prompt of `cfg.prompts` that `cfg.out` does not answer yet."""
    out = Path(cfg.out)
    prompts = read_prompts(cfg.prompts)
    if cfg.server:
        servers = Servers(cfg.server, timeout=cfg.server_timeout)
        cfg = dataclasses.replace(cfg, served_model=servers.served_model(cfg.served_model))
    else:
        cfg = resolve(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_identity(cfg, out, _SERVED if cfg.server else _IN_PROCESS)
    done = read_done(out, prompts)
    pending = [p for p in prompts if p.row not in done]
    log.info("generate: %d prompts in %s, %d already answered in %s", len(prompts), cfg.prompts, len(done), out)
    if not pending:
        return GenerateResult(len(prompts), 0, len(done), 0, 0.0)
    turns = sum(p.turns for p in pending)
    if turns > len(pending):
        log.info("generate: %d conversations hold %d user turns; every assistant turn is regenerated in order",
                 len(pending), turns)
    if cfg.server:
        log.info("generate: %s answers on %s, %d requests in flight", cfg.served_model, ", ".join(servers.urls),
                 min(cfg.concurrency, len(pending)))
        batches = regenerate(cfg, servers, pending)
    else:
        target = load_for_chat(cfg.model, cfg.device, cfg.dtype)
        render = _renderer(target.tokenizer, cfg.chat_template_kwargs)
        answer = (_fast_backend if cfg.engine == "fast" else _transformers_backend)(cfg, target)
        batches = _regenerate(pending, render, answer, chunk=max(256, 16 * cfg.batch_size))
    progress = _Progress(len(pending))
    start = time.perf_counter()
    new_tokens = 0
    try:
        for records in batches:
            _append(out, records)
            n = sum(r["completion_tokens"] for r in records)
            new_tokens += n
            progress.update(len(records), n)
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    result = GenerateResult(len(prompts), len(pending), len(done), new_tokens, seconds)
    log.info(
        "generate: answered %d prompts (%d tokens, %.1f tok/s) into %s",
        result.answered, new_tokens, result.tokens_per_s, out,
    )
    return result


# A backend answers a list of (key, token ids) requests, yielding lists of (key, text, tokens, finished).
Answer = tuple[int, str, int, bool]


def _regenerate(pending: list[Prompt], render: Any, answer: Any, *, chunk: int):
    """Yield lists of finished records: each chunk of conversations is answered turn by turn (one backend call a
    round, each request the conversation's regenerated history), a record as soon as its last turn is answered."""
    for c in range(0, len(pending), chunk):
        active = [Conversation(p) for p in pending[c : c + chunk]]
        while active:
            by_key = {_key(conv.prompt.row, conv.answered): conv for conv in active}
            requests = [(k, render(conv.next_context())) for k, conv in by_key.items()]
            for answers in answer(requests):
                records = []
                for key, text, n, finished in answers:
                    conv = by_key[key]
                    conv.add(text, n, finished)
                    if conv.done:
                        records.append(conv.record())
                if records:
                    yield sorted(records, key=lambda r: r["source_row"])
            active = [conv for conv in active if not conv.done]


def _key(row: int, turn: int) -> int:
    """Return the request key of a conversation's turn: it seeds sampling, so it depends on (row, turn) alone (a
    first turn keeps its row, as single-turn files always had), never on which chunk or batch it fell in."""
    return row + (turn << 40)


def _renderer(tokenizer: Any, kwargs: dict[str, Any] | None):
    """Return the function that turns a conversation into the token ids the target continues (chat template with
    the generation prompt and --chat-template-kwargs; the template holds any BOS token itself)."""
    extra = dict(kwargs or {})

    def render(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return render


def _fast_backend(cfg: "GenerateConfig", target: Loaded):
    """Return a function that answers requests with the fast decoder (engine.py), yielding answers as they finish."""
    from .engine import FastDecoder, Request

    decoder = FastDecoder(target.model, slots=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                          stop_ids=target.stop_ids, temperature=cfg.temperature, seed=cfg.seed)
    flush_every = max(1, cfg.batch_size // 4)

    def answer(requests: list[tuple[int, list[int]]]):
        # Shortest first: each refill's prompts have similar lengths, so its prefill pads little.
        order = sorted(requests, key=lambda r: (len(r[1]), r[0]))
        answers: list[Answer] = []
        last = time.perf_counter()
        for done in decoder.run((Request(k, ids) for k, ids in order), max_prompt=max(len(r[1]) for r in order)):
            for c in done:
                text = target.tokenizer.decode(c.tokens, skip_special_tokens=True)
                answers.append((c.key, text, len(c.tokens), c.finished))
            # Records reach disk in groups: one fsync per group, not per answer.
            if len(answers) >= flush_every or time.perf_counter() - last > 5.0:
                yield answers
                answers, last = [], time.perf_counter()
        if answers:
            yield answers

    return answer


def _transformers_backend(cfg: "GenerateConfig", target: Loaded):
    """Return a function that answers requests a batch at a time with transformers' generate."""
    import torch

    tokenizer, model, pad_id = target.tokenizer, target.model, target.pad_id
    eos_ids = set(target.stop_ids)
    sample = cfg.temperature > 0
    kwargs: dict[str, Any] = dict(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sample,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
    )
    # Plain temperature sampling: switch off the top-k/top-p filters a generation_config may carry.
    if sample:
        kwargs.update(temperature=cfg.temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)

    def answer(requests: list[tuple[int, list[int]]]):
        # Similar lengths share a batch, so little compute goes to padding.
        order = sorted(requests, key=lambda r: (len(r[1]), r[0]))
        for b in range(0, len(order), cfg.batch_size):
            part = order[b : b + cfg.batch_size]
            # Left padding (load_for_chat sets it): generation continues every row at the same column.
            enc = tokenizer.pad({"input_ids": [ids for _, ids in part]}, return_tensors="pt")
            enc = {k: v.to(cfg.device) for k, v in enc.items()}
            if sample:
                # Seeded per batch by its first request, so a rerun of the same batch draws the same tokens.
                torch.manual_seed(cfg.seed * 1_000_003 + part[0][0])
            with torch.inference_mode():
                seqs = model.generate(**enc, **kwargs)
            new = seqs[:, enc["input_ids"].shape[1] :].tolist()
            answers: list[Answer] = []
            for (key, _), ids in zip(part, new):
                stop = next((k for k, t in enumerate(ids) if t in eos_ids), None)
                kept = ids if stop is None else ids[:stop]
                answers.append((key, tokenizer.decode(kept, skip_special_tokens=True), len(kept), stop is not None))
            yield answers

    return answer

