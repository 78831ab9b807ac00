"""The demo's data: which prompts it answers (bundled ones, and ones the target writes itself), in which order, and
which it holds out.

The held-out prompts are bundled ones spread evenly over the bundled file. They come first in the data, so they
fill the store's first shards (a shard holds whole prompts, each prompt's rows adjacent), and train holds those
shards out by `--val-shards`: nothing of a held-out prompt is trained on, and demos with more or fewer
self-written prompts score the same held-out prompts.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..runtime.atomic import write_atomic
from ..errors import ConfigError

DATA_FILE = "data.jsonl"

__all__ = ["DATA_FILE", "held_out_prompts", "data_order", "prompt_lines", "write_lines", "write_data", "decoded_rows",
           "write_held_out_prompts"]


def held_out_prompts(bundled: int, n: int) -> list[int]:
    """Return the indices of the n held-out bundled prompts, spread evenly over the first `bundled`."""
    if not 1 <= n < bundled:
        raise ConfigError(f"the demo holds out {n} of its {bundled} bundled prompts; it needs 1 to {bundled - 1}")
    return [j * bundled // n for j in range(n)]


def data_order(bundled: int, extra: int, held_out: int) -> list[int]:
    """Return prompt indices in data order: the held-out bundled prompts, the other bundled ones, then the
    `extra` self-written ones (indices bundled .. bundled + extra - 1)."""
    first = held_out_prompts(bundled, held_out)
    chosen = set(first)
    return first + [i for i in range(bundled) if i not in chosen] + list(range(bundled, bundled + extra))


def prompt_lines(bundled_file: Path, n: int, self_written: Path | None) -> tuple[list[str], list[str]]:
    """Return the JSON prompt lines: the first n bundled ones, and those of `dflash generate --self-prompts`."""
    from ..generate.prompts import written_lines
    from ..generate.self_prompts import read_written

    bundled = [raw.decode("utf-8") for _, raw in written_lines(bundled_file)][:n]
    written = read_written(self_written)[0] if self_written is not None else []
    return bundled, [json.dumps({"prompt": text}, ensure_ascii=False) for text in written]


def write_lines(path: Path, lines: list[str], *, repeat: int = 1) -> Path:
    """Return path after writing the lines, each `repeat` times in a row (rewritten only if different)."""
    text = "".join(ln + "\n" for ln in lines for _ in range(repeat))
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_atomic(path, text)
    return path


def _answers_by_row(path: Path, rows: int) -> list[str]:
    """Return the JSON line of each source row 0..rows-1 of a finished `generate` output (torn lines skipped)."""
    from ..generate.prompts import written_lines

    by_row: dict[int, str] = {}
    for _, line in written_lines(path):
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


def write_data(out: Path, greedy: Path, sampled: Path | None, prompts: int, samples: int) -> Path:
    """Return OUT/data.jsonl: each prompt's greedy answer followed by its sampled ones, in prompt order.

    A prompt's rows are adjacent and a shard holds whole prompts, so a held-out shard holds every answer of its
    prompts: nothing of a held-out prompt is trained on. The greedy answers' generation record goes beside it,
    so the store says in which numerics the data was made.
    """
    from ..conversations import sidecar_path

    lines = _answers_by_row(greedy, prompts)
    extra = _answers_by_row(sampled, prompts * samples) if sampled is not None and samples else []
    text = "".join(
        lines[i] + "\n" + "".join(extra[i * samples + j] + "\n" for j in range(samples if extra else 0))
        for i in range(prompts)
    )
    path = out / DATA_FILE
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_atomic(path, text)
    if sidecar_path(greedy).is_file():
        write_atomic(sidecar_path(path), sidecar_path(greedy).read_bytes())
    return path


def decoded_rows(val_sample_ids: list[list[int]], rows_per_prompt: int, n: int) -> list[int]:
    """Return the data rows whose prompts are decoded: the greedy row of each held-out prompt, the first n."""
    rows = [int(r) for ids in val_sample_ids for r in ids if int(r) % rows_per_prompt == 0]
    return rows[:n]


def write_held_out_prompts(store_dir: Path, data: Path, run_dir: Path, n: int, rows_per_prompt: int,
                           out: Path) -> Path:
    """Return `out` after writing the first n prompts of the held-out shards to it, one JSON line of chat messages
    each (their turns without the target's answer, which is what decoding writes again): the file the demo decodes
    and that `dflash eval --prompts` replays."""
    from ..conversations import read_rows
    from ..storage import Store
    from ..drafter.folders import read_run_record

    store = Store.open(str(store_dir))
    val = read_run_record(run_dir)["resolved"]["val_shards"]
    rows = read_rows((str(data),))
    # A prompt's sampled answers follow its greedy one; it is decoded once.
    picked = decoded_rows([store.read_shard(sid).sample_ids.tolist() for sid in val], rows_per_prompt, n)
    return write_lines(out, [json.dumps({"messages": rows[row].messages[:-1]}, ensure_ascii=False) for row in picked])
