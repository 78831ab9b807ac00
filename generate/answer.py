"""`dflash generate`: answer prompts with the target through its chat template, appending resumable JSONL records.

DFlash drafters learn the target's own continuations, so the recipe regenerates the answers of a prompt set with
the target before extraction. Each output line is `{"messages": [... , {"role": "assistant", ...}], "source_row":
i, ...}`, ready for `dflash extract --data`. Records are appended and fsynced batch by batch; a rerun reads what is
there, drops a torn last line left by a kill, and answers only the rows that have no record yet.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import append_lines, repair_torn_tail
from ..conversations import message
from ..errors import ConfigError, InputError
from ..runtime import Progress as Display
from .model import NUMERICS, Loaded, check_identity, load, resolve
from .prompts import Prompt, read_prompts

if TYPE_CHECKING:
    from ..config import GenerateConfig

__all__ = ["GenerateResult", "read_done", "run"]

log = logging.getLogger(__name__)

# The options that decide what an answer is (numerics included); a rerun into the same --out must keep them.
_IDENTITY_FIELDS = ("model", "max_new_tokens", "temperature", "seed") + NUMERICS
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
    data = out.read_bytes()
    done: set[int] = set()
    for lineno, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            row = rec["source_row"]
            messages = rec["messages"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(
                f"--out {out} line {lineno}: expected a record written by `dflash generate`, found {raw[:60]!r}; "
                "move the file away or pass a new --out"
            ) from None
        if not isinstance(row, int) or not 0 <= row < len(prompts) or messages[:-1] != prompts[row].messages:
            raise InputError(
                f"--out {out} line {lineno}: source_row {row!r} does not answer that row of the prompts file "
                "(the prompts changed since it was written); pass a new --out or the original --prompts"
            )
        done.add(row)
    return done


class _Progress:
    """Prompts answered and tokens/s, shown with rate and ETA (see runtime.Progress)."""

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
    cfg = resolve(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_identity(cfg, out, _IDENTITY_FIELDS)
    done = read_done(out, prompts)
    pending = [p for p in prompts if p.row not in done]
    log.info("generate: %d prompts in %s, %d already answered in %s", len(prompts), cfg.prompts, len(done), out)
    if not pending:
        return GenerateResult(len(prompts), 0, len(done), 0, 0.0)
    if cfg.backend == "vllm":
        answer = _vllm_backend(cfg)
    elif cfg.engine == "fast":
        answer = _fast_backend(cfg, load(cfg))
    else:
        answer = _transformers_backend(cfg, load(cfg))
    progress = _Progress(len(pending))
    start = time.perf_counter()
    new_tokens = 0
    try:
        for records in answer(pending):
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


def _record(prompt: Prompt, text: str, n_tokens: int, finished: bool) -> dict[str, Any]:
    return {
        "messages": prompt.messages + [message("assistant", text)],
        "source_row": prompt.row,
        "completion_tokens": n_tokens,
        "finish_reason": "stop" if finished else "length",
    }


def _chat_ids(tokenizer: Any, pending: list[Prompt]) -> tuple[list[str], list[list[int]]]:
    """Return each prompt's chat-template text and its token ids (the template holds any BOS token itself)."""
    texts = [tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True) for p in pending]
    return texts, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _fast_backend(cfg: "GenerateConfig", target: Loaded):
    """Return a function that yields lists of records as the fast decoder finishes them (engine.py)."""
    from .engine import FastDecoder, Request

    decoder = FastDecoder(target.model, slots=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                          stop_ids=target.stop_ids, temperature=cfg.temperature, seed=cfg.seed)
    flush_every = max(1, cfg.batch_size // 4)

    def answer(pending: list[Prompt]):
        _, ids = _chat_ids(target.tokenizer, pending)
        by_row = {p.row: p for p in pending}
        # Shortest first: each refill's prompts have similar lengths, so its prefill pads little.
        order = sorted(range(len(pending)), key=lambda i: (len(ids[i]), pending[i].row))
        requests = (Request(pending[i].row, ids[i]) for i in order)
        records: list[dict[str, Any]] = []
        last = time.perf_counter()
        for done in decoder.run(requests, max_prompt=max(map(len, ids))):
            for c in done:
                text = target.tokenizer.decode(c.tokens, skip_special_tokens=True)
                records.append(_record(by_row[c.key], text, len(c.tokens), c.finished))
            # Records reach disk in groups: one fsync per group, not per answer.
            if len(records) >= flush_every or time.perf_counter() - last > 5.0:
                yield records
                records, last = [], time.perf_counter()
        if records:
            yield records

    return answer


def _transformers_backend(cfg: "GenerateConfig", target: Loaded):
    """Return a function that yields one list of records per batch of prompts, using transformers' generate."""
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

    def answer(pending: list[Prompt]):
        texts, ids = _chat_ids(tokenizer, pending)
        lengths = [len(x) for x in ids]
        # Similar lengths share a batch, so little compute goes to padding.
        order = sorted(range(len(pending)), key=lambda i: (lengths[i], pending[i].row))
        for b in range(0, len(order), cfg.batch_size):
            idx = order[b : b + cfg.batch_size]
            enc = tokenizer([texts[i] for i in idx], add_special_tokens=False, padding=True, return_tensors="pt")
            enc = {k: v.to(cfg.device) for k, v in enc.items()}
            if sample:
                # Seeded per batch by its first row, so a rerun of the same batch draws the same tokens.
                torch.manual_seed(cfg.seed * 1_000_003 + pending[idx[0]].row)
            with torch.inference_mode():
                seqs = model.generate(**enc, **kwargs)
            new = seqs[:, enc["input_ids"].shape[1] :].tolist()
            records = []
            for i, ids in zip(idx, new):
                stop = next((k for k, t in enumerate(ids) if t in eos_ids), None)
                kept = ids if stop is None else ids[:stop]
                text = tokenizer.decode(kept, skip_special_tokens=True)
                records.append(_record(pending[i], text, len(kept), stop is not None))
            records.sort(key=lambda r: r["source_row"])
            yield records

    return answer


def _vllm_backend(cfg: "GenerateConfig"):
    """Return a function that yields records in batches, using vLLM; ConfigError when vLLM is not installed."""
    try:
        import vllm
    except ImportError:
        raise ConfigError(
            "--backend vllm: expected the vllm package, found it missing; run `pip install vllm` "
            "or use --backend transformers"
        ) from None
    if cfg.device != "cuda":
        raise ConfigError("--backend vllm runs on GPUs only; pass --device cuda or use --backend transformers")
    llm = vllm.LLM(model=cfg.model, seed=cfg.seed, dtype="auto")
    tokenizer = llm.get_tokenizer()
    params = vllm.SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, seed=cfg.seed)

    def answer(pending: list[Prompt]):
        # vLLM schedules its own batches; we hand it chunks only so records reach disk (and resume) as it goes.
        chunk = max(cfg.batch_size, 256)
        for b in range(0, len(pending), chunk):
            part = pending[b : b + chunk]
            texts = [tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True) for p in part]
            ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
            records = []
            for p, o in zip(part, outs):
                c = o.outputs[0]
                records.append(_record(p, c.text, len(c.token_ids), c.finish_reason == "stop"))
            yield records

    return answer
