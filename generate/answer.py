"""`dflash generate`: answer prompts with the target through its chat template, appending resumable JSONL records.

DFlash drafters learn the target's own continuations, so the recipe regenerates the answers of a prompt set with
the target before extraction. Each output line is `{"messages": [... , {"role": "assistant", ...}], "source_row":
i, ...}`, ready for `dflash extract --data`. Records are appended and fsynced batch by batch; a rerun reads what is
there, drops a torn last line left by a kill, and answers only the rows that have no record yet.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import append_lines, repair_torn_tail
from ..conversations import message
from ..errors import ConfigError, InputError
from ..runtime import Progress as Display
from .prompts import Prompt, read_prompts

if TYPE_CHECKING:
    from ..config import GenerateConfig

__all__ = ["GenerateResult", "read_done", "run"]

log = logging.getLogger(__name__)

# The options that decide what an answer is; a rerun into the same --out must keep them.
_IDENTITY_FIELDS = ("model", "max_new_tokens", "temperature", "seed")
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


def _check_identity(cfg: "GenerateConfig", out: Path) -> None:
    """Save the config beside `out`, or refuse to resume into it with options that change the answers."""
    from ..config import GenerateConfig

    saved_path = out.with_name(out.name + ".config.json")
    if saved_path.exists():
        saved = GenerateConfig.load(saved_path)
        for name in _IDENTITY_FIELDS:
            old, new = getattr(saved, name), getattr(cfg, name)
            if name == "model":
                old, new = os.path.abspath(old), os.path.abspath(new)
            if old != new:
                raise ConfigError(
                    f"--out {out} was generated with --{name.replace('_', '-')} {old} but this run has {new}; "
                    f"rerun with --{name.replace('_', '-')} {old} or pass a new --out"
                )
    else:
        cfg.save(saved_path)


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
    if not Path(cfg.model).is_dir():
        raise InputError(
            f"--model {cfg.model}: expected a Hugging Face model folder, found none; pass a save_pretrained folder "
            "(the embedded target: python -c 'from dflash.assets import smollm2_folder; print(smollm2_folder())')"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_identity(cfg, out)
    done = read_done(out, prompts)
    pending = [p for p in prompts if p.row not in done]
    log.info("generate: %d prompts in %s, %d already answered in %s", len(prompts), cfg.prompts, len(done), out)
    if not pending:
        return GenerateResult(len(prompts), 0, len(done), 0, 0.0)
    if cfg.backend == "vllm":
        answer = _vllm_backend(cfg)
    else:
        answer = _transformers_backend(cfg)
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


def _transformers_backend(cfg: "GenerateConfig"):
    """Return a function that yields one list of records per batch of prompts, using transformers' generate."""
    import torch
    from transformers import AutoTokenizer

    from ..target import load_target

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: expected a CUDA device, found none; rerun with --device cpu")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    if not tokenizer.chat_template:
        raise InputError(f"--model {cfg.model}: expected a tokenizer with a chat template, found none")
    # On CPU, bf16 answers depend on the batch: with left padding SmolLM2's first-token logits moved by 0.9 and
    # "The capital of France is Paris." became "L'Etoile, ..."; even eager attention changed 9 of 16 answers
    # between batch 16 and batch 1. fp32 kept 8 of 8 answers identical between batch 8 and batch 1, so it is
    # what we use, at a cost (bf16 decoded up to ~3x faster on this AVX512-bf16 CPU). GPUs keep the folder's dtype.
    dtype = torch.float32 if cfg.device == "cpu" else "auto"
    model = load_target(cfg.model, device=cfg.device, dtype=dtype)
    # Left padding keeps every prompt's last token at the same column, where generation continues.
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:  # some conversions (transformers 5.17 from GGUF) name no pad token
        tokenizer.pad_token_id = pad_id
    eos_ids = {tokenizer.eos_token_id}
    gen_eos = model.generation_config.eos_token_id
    eos_ids |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
    eos_ids.discard(None)
    if not eos_ids:
        raise InputError(f"--model {cfg.model}: expected an eos token in the tokenizer or generation config, found none")
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
        texts = [tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True) for p in pending]
        # The template already holds any BOS token; the tokenizer must not add a second one.
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
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
