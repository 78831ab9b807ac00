"""How often flex attention compiles over a run's batches (issue 44): the batch shapes extract packs for the bench's
1M-token conversations (bench/extract.py's lengths, 193-4,001 tokens; extract/plan.py's packing, a shard at a
time), run in order through the truncated runner of a tiny target on flex attention, after the start-up
self-check's 2 rows, once as the runner runs a batch of one row today (the row twice, while the copies cost less
than the runner's rent) and once as before (the row alone), each in a new process with empty compiler caches: per
arm the batches that compiled, the graphs and the seconds they took, the rent paid, and the whole pass.

    python bench/flex_compiles.py [--arch gemma3_text] [--device cpu|cuda] [--tokens 1000000]

On the CPU flex takes no sinks, so the default is gemma3_text (sliding and full layers: two mask kinds, as
gpt-oss); on CUDA pass --arch gpt_oss (sinks). The target is tiny (hidden 32): what is measured is compilation,
which a larger shape's layers share, not the forward's speed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def batch_shapes(tokens: int, shards: int, batch_tokens: int) -> list[tuple[int, int]]:
    """Return the (rows, length) of each forward extract packs for the bench's conversations of ~tokens tokens."""
    from extract import make_conversations  # bench/extract.py

    from dflash.extract.plan import pack_batches

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "conv.jsonl"
        make_conversations(path, tokens)
        lengths = []
        for line in path.read_text().splitlines():
            m = json.loads(line)["messages"]
            lengths.append(len(m[0]["content"]) + len(m[1]["content"]) + 30)  # one token a character + template
    per = -(-len(lengths) // shards)
    shapes = []
    for s in range(0, len(lengths), per):
        shard = lengths[s : s + per]
        shapes += [(len(b), max(shard[i] for i in b)) for b in pack_batches(shard, batch_tokens)]
    return shapes


def run_arm(path: Path, device, shapes: list[tuple[int, int]], one_row_as_two: bool, batch_tokens: int) -> dict:
    """Return what flex compiled over the batches, the runner as the arm says."""
    import torch

    from dflash.targets import kernels
    from dflash.targets.kernels import Kernels
    from dflash.targets.load import load_for_features
    from dflash.targets.runner import TargetRunner

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_for_features(path, device, dtype)
    runner = TargetRunner(model, [1, 3], check=False, warm_tokens=batch_tokens)  # the run's batch size, as extract's
    runner.one_row_as_two = one_row_as_two
    kernels.apply(model, Kernels("flex_attention", runner.kernels.experts))
    runner.kernels = kernels.current(model)
    torch._dynamo.reset()

    def forward(shape: tuple[int, int]) -> float:
        t = time.perf_counter()
        runner.hidden(torch.randint(0, 200, shape, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    check_s = forward((2, 160))  # the self-check's rows (longer than the tiny targets' windows)
    graphs0 = kernels.graphs_compiled()
    compiled, t0 = [], time.perf_counter()
    for i, shape in enumerate(shapes):
        before = kernels.graphs_compiled()
        s = forward(shape)
        if kernels.graphs_compiled() != before:
            compiled.append({"batch": i, "shape": list(shape), "graphs": kernels.graphs_compiled() - before,
                             "s": round(s, 2)})
    return {"one_row_as_two": one_row_as_two, "rent_paid_s": round(runner._paid(), 3), "start_up_graphs": graphs0,
            "start_up_s": round(check_s, 2),
            "run_graphs": kernels.graphs_compiled() - graphs0, "compiling_batches": compiled,
            "compiling_s": round(sum(c["s"] for c in compiled), 2), "run_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gemma3_text", help="a tiny target family of dflash/tests/tiny_targets.py")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=4, help="shards the run's rows fall into (4 at 1M tokens)")
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arm", choices=("two", "one"), default=None, help=argparse.SUPPRESS)  # one arm, in a child
    args = ap.parse_args()

    import torch

    from dflash.tests.tiny_targets import build_tiny_target

    shapes = batch_shapes(args.tokens, args.shards, args.batch_tokens)
    if args.arm is not None:
        with tempfile.TemporaryDirectory() as d:
            path = build_tiny_target(Path(d) / args.arch, args.arch, num_layers=6, hidden_size=32)
            print("ARM " + json.dumps(run_arm(path, torch.device(args.device), shapes, args.arm == "two",
                                                 args.batch_tokens)), flush=True)
        return
    print(f"{len(shapes)} batches, {len(set(shapes))} shapes, {sum(1 for r, _ in shapes if r == 1)} of one row",
          flush=True)
    arms = []
    for arm in ("two", "one"):  # each in a new process with empty compiler caches: neither finds the other's graphs
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--arm", arm], env=env, check=True,
                                 capture_output=True, text=True).stdout
        arms.append(json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ARM "))))
        print(json.dumps(arms[-1]), flush=True)
    now, before = arms
    print(f"{args.arch} on {args.device}: flex compiled {now['run_graphs']} graphs in {len(now['compiling_batches'])} "
          f"of {len(shapes)} batches ({now['compiling_s']} s) with a batch of one row run as two, "
          f"{before['run_graphs']} in {len(before['compiling_batches'])} ({before['compiling_s']} s) as before; "
          f"the pass {now['run_s']} s against {before['run_s']} s ({before['run_s'] / now['run_s']:.2f}x)")
    if args.out:
        args.out.write_text(json.dumps({"shapes": len(shapes), "arms": arms}, indent=1))


if __name__ == "__main__":
    main()
