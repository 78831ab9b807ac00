"""What handing the extraction plan to spawned workers costs, against what each worker would pay otherwise.

Writes a synthetic conversation file of chat-sized rows (1-4 user/assistant turns, ~5 KB of text a row, ~1,500
tokens), then times: scanning it into the row index (`chatfiles.read_rows`: what each worker used to do again),
pickling and loading that index (what the plan carries to every worker), parsing every row once (what the parent's
`plan.scan_rows` does), and pickling and loading the parsed rows of a sample of them (the alternative: handing over
parsed rows), scaled to the whole file.

    python bench/plan_handoff.py --rows 800000 --work /tmp/handoff     # ~4.2 GB of JSONL, ~2 GB of memory
"""
from __future__ import annotations

import argparse
import json
import pickle
import random
import time
from pathlib import Path


def write_rows(path: Path, n: int, seed: int = 0) -> None:
    """Write n JSONL rows of 1-4 user/assistant turns cut from one random text (~5 KB a row)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    text = " ".join(rng.choice(words) for _ in range(400_000))
    with open(path, "w") as f:
        for _ in range(n):
            msgs = []
            for _ in range(rng.choice([1, 1, 2, 2, 3, 4])):
                for role, mean in (("user", 500), ("assistant", 1800)):
                    k = int(rng.expovariate(1 / mean)) + 20
                    a = rng.randrange(len(text) - k)
                    msgs.append({"role": role, "content": text[a:a + k]})
            f.write(json.dumps({"messages": msgs}) + "\n")


def _round_trip(obj: object) -> tuple[int, float, float]:
    """Return (pickled bytes, seconds to pickle, seconds to load) of obj."""
    t = time.perf_counter()
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    dump_s = time.perf_counter() - t
    t = time.perf_counter()
    pickle.loads(blob)
    return len(blob), dump_s, time.perf_counter() - t


def main() -> None:
    from dflash.conversations import read_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=800_000)
    ap.add_argument("--sample", type=int, default=100_000, help="rows parsed and pickled, scaled to --rows")
    ap.add_argument("--work", default="/tmp/plan-handoff")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"conv{args.rows}.jsonl"
    if not data.exists():
        write_rows(data, args.rows)
    t = time.perf_counter()
    rows = read_rows([str(data)])
    scan_s = time.perf_counter() - t
    size, dump_s, load_s = _round_trip(rows)
    print(f"{len(rows):,} rows, {data.stat().st_size / 1e9:.2f} GB: index scanned in {scan_s:.1f} s, pickled to "
          f"{size / 1e6:.1f} MB in {dump_s * 1e3:.0f} ms, loaded in {load_s * 1e3:.0f} ms")
    n = min(args.sample, len(rows))
    t = time.perf_counter()
    parsed = rows[0:n]
    parse_s = time.perf_counter() - t
    size, dump_s, load_s = _round_trip(parsed)
    k = len(rows) / n
    print(f"parsed rows, {n:,} measured and scaled x{k:.1f}: parse {parse_s * k:.0f} s, pickle "
          f"{size * k / 1e9:.1f} GB in {dump_s * k:.0f} s, load {load_s * k:.0f} s")


if __name__ == "__main__":
    main()
