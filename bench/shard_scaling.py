"""Benchmark of weight-sharded extraction on 2, 4 and 8 GPUs of one machine (issue 43): tokens a second a GPU of
`dflash extract --shard-weights K` against plain data-parallel extraction of the same target on the same K GPUs
and against the target resident on one GPU, with the collective's share of a forward, through the real command.

    source bench/device_env.sh && python3 bench/shard_scaling.py --work /tmp/bss --out /tmp/bss/shard_scaling.json
    python3 bench/shard_scaling.py --smoke --work /tmp/bss-smoke     # the same path on the CPU: gloo, tiny shapes

The target is Qwen3-32B-shaped (bench/offload.py's qwen3_32b: hidden 5,120, 64 layers, bf16, --layers auto): one
copy fits one H200, so all three placements run it. Runs, each a subprocess of the real command with random
weights made inside every rank (this script with --child: the loads are replaced by a seeded random init on the
rank's device, sharded for --shard-weights K over a K-rank mesh with target.sharded's own FSDP plan):
  resident      one process, --gpus 0, --shard-weights 1 (the command's default batch, 32,768 tokens);
  resident_64k  the same at --batch-tokens 65,536 (the sharded runs' default batch);
  sharded_K     torchrun --nproc-per-node K, --shard-weights K (64K-token batches by default);
  replicated_K  torchrun --nproc-per-node K, --shard-weights 1: a whole copy per GPU (data parallel).
Every K of --k that the machine has GPUs for runs (2,4,8 by default); each run gets --tokens-per-gpu tokens a GPU.
Each rank reports its tokens, its first forward and last commit (wall clock: a run's tok/s is its tokens over the
span from the first forward of any rank to the last commit of any, every byte on disk), and a torch.profiler trace
of a few of its forwards (after --profile-skip warm ones): the forward's wall time, the collective's time in it
(CUDA: NCCL kernels; CPU: gloo's all-gather threads) and the part of it that was exposed (CUDA: NCCL kernel time
when no other kernel ran; CPU: the forward thread's time in FSDP's pre-forward: all-gather issue, wait, copy-out).
The store goes to --store-dir (/dev/shm by default on GPUs: eight GPUs write faster than a local disk takes) and
is deleted after each run. The results JSON is rewritten after every run; the same command skips the runs it
holds, so a machine's per-command limit is met with --deadline-s and a rerun.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import extract as bx  # noqa: E402  (bench/extract.py: the conversations)
import offload as bo  # noqa: E402  (bench/offload.py: the Qwen3-32B shape)
import targets as bt  # noqa: E402  (bench/targets.py: the target folder, the random init)

RANK_DIR_ENV, PROFILE_ENV = "BENCH_RANK_DIR", "BENCH_PROFILE"  # the child's report folder; "skip,count"


# ---- the child: the command with random weights, each rank reporting its times and a profile of a few forwards


def random_sharded(model_dir: str | Path, device: torch.device, dtype: str, shard: int, offload: bool) -> object:
    """Return a random-init causal LM of the folder's config sharded as target.sharded.load_sharded shards a loaded
    one: target.sharded's FSDP plan over `shard` ranks of the process group (a (replicate, shard) mesh when the world
    is larger), built whole on the rank's device from the same seed on every rank, then sharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from dflash.targets import sharded

    torch.manual_seed(0)  # every rank builds the same weights: its shards are then parts of one model
    model = bt.random_target(model_dir, device, getattr(torch, dtype))
    path, world = sharded.text_path(model), dist.get_world_size()
    if shard == 1:  # --offload cpu: a rank's own copy in host memory, streamed a layer ahead as the product does
        from dflash.targets.streamed import stream_layers

        model.dflash_stream = stream_layers(model, model.get_submodule(path), device)
    else:
        shape, names = ((world // shard, shard), ("dp_replicate", "fsdp")) if world > shard else ((shard,), ("fsdp",))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=True)} if offload and device.type == "cuda" else {}
        text = model.get_submodule(path)
        for name in sharded._plan(model, path):  # the product's plan: every decoder layer, an untied lm_head
            for m in (list(text.layers) if name.endswith(".layers.*") else [model.get_submodule(name)]):
                fully_shard(m, mesh=mesh, reshard_after_forward=True, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model.eval()


def random_whole(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> object:
    """Return bench/targets.py's random target from the same seed as random_sharded's."""
    torch.manual_seed(0)
    return bt.random_target(model_dir, device, dtype)


class Probe:
    """What a rank reports (RANK_DIR_ENV/rank-<r>.json): its real forwards (an empty lockstep forward of one token
    is not one), its first forward and last commit in wall-clock time, its worker's totals, and a profile of
    `count` forwards after `skip`."""

    def __init__(self, folder: Path, skip: int, count: int) -> None:
        self.folder, self.skip, self.count = folder, skip, count
        self.rank = int(os.environ.get("RANK", "0"))
        self.forwards = self.tokens = self.padded = 0
        self.first_forward = self.last_commit = None
        self.prof, self.windows, self.profile = None, [], None

    def features(self, orig):
        def features(runner, input_ids, lengths):
            if sum(lengths) <= 1:  # an empty lockstep forward (a rank with no rows left)
                return orig(runner, input_ids, lengths)
            self.forwards += 1
            self.tokens, self.padded = self.tokens + sum(lengths), self.padded + input_ids.numel()
            if self.first_forward is None:
                self.first_forward = time.time()
            if not self.skip < self.forwards <= self.skip + self.count:
                return orig(runner, input_ids, lengths)
            cuda = input_ids.device.type == "cuda"
            if self.prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.start()
            if cuda:
                torch.cuda.synchronize(input_ids.device)
            t0 = time.perf_counter()
            with torch.profiler.record_function("bench_forward"):
                out = orig(runner, input_ids, lengths)
                if cuda:
                    torch.cuda.synchronize(input_ids.device)
            self.windows.append((time.perf_counter() - t0, sum(lengths)))
            if self.forwards == self.skip + self.count:
                self.stop()
            return out

        return features

    def commit(self, orig):
        def commit(*args, **kwargs):
            out = orig(*args, **kwargs)
            self.last_commit = time.time()
            return out

        return commit

    def stop(self) -> None:
        if self.prof is None or self.profile is not None:
            return
        self.prof.stop()
        self.profile = profile_summary(self.prof.events(), self.windows)
        if self.rank == 0:
            self.prof.export_chrome_trace(str(self.folder / "trace-rank0.json.gz"))

    def fill_shards(self, orig):
        def fill_shards(*args, **kwargs):
            result = orig(*args, **kwargs)
            self.stop()
            peak = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None
            keep = ("device", "shards", "tokens", "padded_tokens", "batches", "seconds", "wait_s", "steady_s")
            report = {"rank": self.rank, **{k: result.get(k) for k in keep}, "forwards": self.forwards,
                      "forward_tokens": self.tokens, "forward_padded_tokens": self.padded,
                      "first_forward": self.first_forward, "last_commit": self.last_commit,
                      "peak_gpu_reserved": peak, "profile": self.profile}
            path = self.folder / f"rank-{self.rank}.json"
            path.with_suffix(".tmp").write_text(json.dumps(report))
            os.replace(path.with_suffix(".tmp"), path)
            return result

        return fill_shards


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _within(spans: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Return the parts of merged spans inside merged windows."""
    return _merged([(max(a, c), min(b, d)) for a, b in spans for c, d in windows if min(b, d) > max(a, c)])


def _minus(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Return the length of merged spans not covered by merged cover."""
    return _length(spans) - _length(_within(spans, cover))


def profile_summary(events, windows: list[tuple[float, int]]) -> dict:
    """Return a profile's figures (seconds): the profiled forwards' wall time and tokens, the collective's time in
    them and its exposed part (see the module's docstring)."""
    span = lambda e: (e.time_range.start / 1e6, e.time_range.end / 1e6)  # noqa: E731  (microseconds)
    inside = _merged([span(e) for e in events if e.name == "bench_forward"])
    device = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    if device:  # NCCL's kernels, and peer-to-peer copies where NCCL moves the data by copy engine
        comm = [e for e in device if "nccl" in e.name.lower() or "ptop" in e.name.lower()]
        coll = _within(_merged([span(e) for e in comm]), inside)
        other = _within(_merged([span(e) for e in device if e not in comm]), inside)
        collective, exposed, how = _length(coll), _minus(coll, other), "cuda"
    else:
        comm = [e for e in events if e.name.startswith("gloo:")]
        coll = _within(_merged([span(e) for e in comm]), inside)
        pre = _within(_merged([span(e) for e in events if e.name.startswith("FSDP::pre_forward")]), inside)
        collective, exposed, how = _length(coll), _length(pre), "cpu"
    wall, tokens = sum(w for w, _ in windows), sum(n for _, n in windows)
    return {"forwards": len(windows), "tokens": tokens, "wall_s": round(wall, 4), "how": how,
            "collective_s": round(collective, 4), "exposed_s": round(exposed, 4),
            "collective_events": sum(1 for e in comm if _within([span(e)], inside))}


def child(argv: list[str]) -> None:
    """Run the `dflash` entry point with random weights made inside it and this rank's Probe (what --child does)."""
    import dflash.extract.worker as worker
    import dflash.targets.load as loading
    import dflash.targets.sharded as sharded
    from dflash.cli import main
    from dflash.targets.runner import TargetRunner

    skip, count = map(int, os.environ.get(PROFILE_ENV, "2,3").split(","))
    probe = Probe(Path(os.environ[RANK_DIR_ENV]), skip, count)
    loading.load_for_features = random_whole
    bt.skip_weight_check()
    sharded.load_sharded = random_sharded
    TargetRunner.features = probe.features(TargetRunner.features)
    worker._commit = probe.commit(worker._commit)
    worker.fill_shards = probe.fill_shards(worker.fill_shards)
    main(argv)


# ---- the parent: the runs, their figures, the table


def runs_of(ks: list[int], smoke: bool) -> list[tuple[str, int, list[str]]]:
    """Return (name, ranks, extract flags) of every run, the resident ones first."""
    wide = "4096" if smoke else "65536"  # a CPU's tiny target: the same-batch run at a batch it takes in seconds
    out = [("resident", 1, ["--shard-weights", "1"]),
           ("resident_64k", 1, ["--shard-weights", "1", "--batch-tokens", wide])]
    for k in ks:
        out += [(f"sharded_{k}", k, ["--shard-weights", str(k)]), (f"replicated_{k}", k, ["--shard-weights", "1"])]
    return out


def _descendants(pid: int) -> list[int]:
    """Return the pids of every process below pid (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def launch(cmd: list[str], log: Path, timeout: float | None) -> int | None:
    """Run cmd with stderr and stdout to log; return its exit code (None: stopped at the timeout, with every process
    it started: SIGTERM, which torchrun passes to its ranks, then SIGKILL to any left after 30 s)."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            below = _descendants(p.pid)
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for pid in below:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return None


def figures(name: str, ranks: int, folder: Path, text: str, wall: float) -> dict:
    """Return one run's figures from its ranks' reports and rank 0's log."""
    reports = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(ranks)]
    working = [r for r in reports if r["first_forward"] is not None and r["last_commit"] is not None]
    span = max(r["last_commit"] for r in working) - min(r["first_forward"] for r in working)
    tokens = sum(r["tokens"] for r in reports)
    summary = re.search(r"samples, ([\d,]+) tokens", text)
    placement = re.search(r"weights: (.*)$", text, re.M)
    profiles = [r["profile"] for r in reports if r["profile"] and r["profile"]["wall_s"] > 0]
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    forwards = sum(r["forwards"] for r in reports)
    return {
        "ranks": ranks, "tokens": tokens, "store_tokens": int(summary.group(1).replace(",", "")) if summary else None,
        "wall_s": round(wall, 1), "span_s": round(span, 3), "tok_s": round(tokens / span),
        "tok_s_per_gpu": round(tokens / span / ranks), "forwards": forwards,
        "mean_batch_tokens": round(sum(r["forward_tokens"] for r in reports) / max(1, forwards)),
        "mean_batch_padded": round(sum(r["forward_padded_tokens"] for r in reports) / max(1, forwards)),
        "rank_steady_tok_s": [round(r["tokens"] / r["steady_s"]) if r["steady_s"] else 0 for r in reports],
        "profiled_forward_tok_s_per_gpu": mean([p["tokens"] / p["wall_s"] for p in profiles]),
        "collective_share": mean([p["collective_s"] / p["wall_s"] for p in profiles]),
        "exposed_collective_share": mean([p["exposed_s"] / p["wall_s"] for p in profiles]),
        "profile_how": profiles[0]["how"] if profiles else None,
        "peak_gpu_reserved_gb": (round(max(r["peak_gpu_reserved"] for r in reports) / 1e9, 1)
                                 if reports[0]["peak_gpu_reserved"] is not None else None),
        "placement": placement.group(1) if placement else None, "reports": reports}


def table(runs: dict) -> list[dict]:
    """Return a row per K: per-GPU tok/s sharded and replicated, each over one resident GPU, sharded / replicated."""
    base, wide = runs.get("resident"), runs.get("resident_64k")
    ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
    rows = []
    for k in sorted({int(n.split("_")[1]) for n in runs if n.startswith(("sharded_", "replicated_"))}):
        s, r = runs.get(f"sharded_{k}"), runs.get(f"replicated_{k}")
        sg, rg = (s or {}).get("tok_s_per_gpu"), (r or {}).get("tok_s_per_gpu")
        rows.append({"gpus": k, "sharded_tok_s_per_gpu": sg, "replicated_tok_s_per_gpu": rg,
                     "resident_tok_s": (base or {}).get("tok_s"), "resident_64k_tok_s": (wide or {}).get("tok_s"),
                     "sharded_over_resident": ratio(sg, (base or {}).get("tok_s")),
                     "sharded_over_resident_64k": ratio(sg, (wide or {}).get("tok_s")),
                     "replicated_over_resident": ratio(rg, (base or {}).get("tok_s")),
                     "sharded_over_replicated": ratio(sg, rg),
                     "collective_share": (s or {}).get("collective_share"),
                     "exposed_collective_share": (s or {}).get("exposed_collective_share"),
                     "sharded_batch_tokens": (s or {}).get("mean_batch_tokens"),
                     "replicated_batch_tokens": (r or {}).get("mean_batch_tokens")})
    return rows


def print_table(runs: dict, rows: list[dict]) -> None:
    for name, r in runs.items():
        print(f"  {name}: {r['tok_s']:,} tok/s on {r['ranks']} rank(s) = {r['tok_s_per_gpu']:,} a GPU "
              f"({r['tokens']:,} tokens in {r['span_s']:.1f} s, {r['forwards']} forwards of {r['mean_batch_tokens']:,} "
              f"tokens); profiled forward {r['profiled_forward_tok_s_per_gpu'] or 0:,.0f} tok/s a GPU, collective "
              f"{r['collective_share']} of it, exposed {r['exposed_collective_share']}; peak GPU "
              f"{r['peak_gpu_reserved_gb']} GB", flush=True)
    print("GPUs | sharded tok/s/GPU | / resident | replicated tok/s/GPU | / resident | sharded / replicated | "
          "collective share (exposed)")
    for w in rows:
        print(f"{w['gpus']} | {w['sharded_tok_s_per_gpu']} | {w['sharded_over_resident']} | "
              f"{w['replicated_tok_s_per_gpu']} | {w['replicated_over_resident']} | {w['sharded_over_replicated']} | "
              f"{w['collective_share']} ({w['exposed_collective_share']})", flush=True)


def gpu_name() -> str:
    """Return GPU 0's name from nvidia-smi (torch would hold a context on GPU 0 in this process for every run)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=30)
        return done.stdout.strip() or "cuda"
    except (OSError, subprocess.TimeoutExpired):
        return "cuda"


def store_folder(asked: Path | None, work: Path, gpus: int, need: int) -> Path:
    """Return the stores' folder: --store-dir, else /dev/shm on GPUs when it has room for the largest run's store
    (else --work, said in one line); SystemExit when --store-dir has not the room."""
    if asked is None and gpus:
        shm = Path("/dev/shm")
        if shm.is_dir() and shutil.disk_usage(shm).free > need:
            return shm / "dflash-shard-scaling"
        print(f"/dev/shm has not {need / 1e9:.0f} GB free for the largest run's store: the stores go to {work} "
              "(a disk may then bound the runs of many GPUs)", flush=True)
    folder = asked or work
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(folder).free < need:
        raise SystemExit(f"--store-dir {folder}: the largest run writes up to {need / 1e9:.0f} GB, "
                         f"{shutil.disk_usage(folder).free / 1e9:.0f} GB free; pass a --store-dir with room or a "
                         "lower --tokens-per-gpu")
    return folder


def save(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("bench-shard-scaling-out"))
    ap.add_argument("--out", type=Path, default=None, help="the results JSON [default: WORK/shard_scaling.json]")
    ap.add_argument("--store-dir", type=Path, default=None,
                    help="folder for the stores [default: /dev/shm/dflash-shard-scaling on GPUs, else --work]")
    ap.add_argument("--k", default="2,4,8", help="ranks sharing the target, comma-separated (those <= the GPUs run)")
    ap.add_argument("--tokens-per-gpu", type=int, default=320_000, help="tokens of conversations a GPU, each run")
    ap.add_argument("--shard-rows", type=int, default=None, help="--shard-size of the command [default: its own]")
    ap.add_argument("--profile-skip", type=int, default=2, help="forwards a rank runs before its profiled ones")
    ap.add_argument("--profile-forwards", type=int, default=3, help="forwards a rank profiles (0: none)")
    ap.add_argument("--deadline-s", type=float, default=0, help="start no run that would end after this many "
                    "seconds (the longest run so far decides) and stop one still running then; exit 3 then, and the "
                    "same command continues")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, gloo, 2 and 4 ranks")
    args = ap.parse_args()
    t_start = time.perf_counter()
    gpus = 0 if args.smoke else torch.cuda.device_count()
    if args.smoke:
        args.k = "2,4" if args.k == ap.get_default("k") else args.k
        args.tokens_per_gpu = min(args.tokens_per_gpu, 6_000)
        args.shard_rows, args.profile_skip, args.profile_forwards = args.shard_rows or 1, 0, 2
    elif gpus < 2:
        raise SystemExit(f"this machine has {gpus} GPU(s); the bench needs 2 or more (or --smoke on the CPU)")
    ks = [k for k in map(int, args.k.split(",")) if args.smoke or k <= gpus]
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = (args.out or work / "shard_scaling.json").resolve()
    model_type, config = bo.CASES["qwen3_32b"]
    config = {**config, **bo.SMOKE["qwen3_32b"]} if args.smoke else config
    setup = {"case": "qwen3_32b", "smoke": args.smoke, "tokens_per_gpu": args.tokens_per_gpu,
             "shard_rows": args.shard_rows, "dtype": "bfloat16", "config": config}
    result = {"setup": setup, "runs": {}}
    if out.is_file():
        held = json.loads(out.read_text())
        if held.get("setup") != setup:
            raise SystemExit(f"{out} holds runs of another setup ({held.get('setup')}); pass a new --out or delete it")
        result = held
    # the largest run's store, raw bf16 features of 5 layers (--layers auto), before the codec's saving
    need = args.tokens_per_gpu * max([1, *ks]) * 5 * config["hidden_size"] * 2
    store_root = store_folder(args.store_dir, work, gpus, need)
    result["store_dir"] = str(store_root)
    folder = work / "target"
    bt.make_folder(folder, model_type, config)
    devices = "cpu" if args.smoke else None
    result["machine"] = {"gpus": gpus, "device": gpu_name() if gpus else "cpu",
                         "cpus": os.cpu_count(), "torch": torch.__version__}
    longest = max([r["wall_s"] for r in result["runs"].values()], default=0.0)
    stopped = False
    for name, ranks, flags in runs_of(ks, args.smoke):
        if name in result["runs"]:
            print(f"{name}: held in {out}, skipped", flush=True)
            continue
        left = args.deadline_s - (time.perf_counter() - t_start) if args.deadline_s else None
        if left is not None and (left <= 0 or longest * 1.25 > left):
            print(f"stopped before {name}: {left:.0f} s left of --deadline-s; rerun the same command to continue",
                  flush=True)
            stopped = True
            break
        tokens = args.tokens_per_gpu * ranks
        data = work / f"conversations-{tokens}.jsonl"
        bx.make_conversations(data, tokens)
        store, reports = store_root / f"store-{name}", work / f"ranks-{name}"
        for path in (store, reports):
            shutil.rmtree(path, ignore_errors=True)
        reports.mkdir(parents=True)
        store_root.mkdir(parents=True, exist_ok=True)
        os.environ[RANK_DIR_ENV] = str(reports)
        os.environ[PROFILE_ENV] = f"{args.profile_skip},{args.profile_forwards}"
        gpu_list = devices or ",".join(str(i) for i in range(ranks))
        entry = [str(Path(__file__).resolve()), "--child"]
        if ranks > 1:
            entry = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *entry]
        cmd = [sys.executable, *entry, "extract", "--model", str(folder), "--data", str(data), "--out", str(store),
               "--gpus", gpu_list, "--dtype", "bfloat16", *flags,
               *(["--shard-size", str(args.shard_rows)] if args.shard_rows else [])]
        print(f"{name}: {' '.join(cmd)}", flush=True)
        log = work / f"extract-{name}.log"
        t0 = time.perf_counter()
        code = launch(cmd, log, left)
        wall = time.perf_counter() - t0
        shutil.rmtree(store, ignore_errors=True)
        if code is None:
            print(f"stopped {name} at --deadline-s; rerun the same command to continue", flush=True)
            stopped = True
            break
        text = log.read_text()
        if code != 0:
            raise SystemExit(f"{name} failed ({code}); {log}:\n{text[-3000:]}")
        run = figures(name, ranks, reports, text, wall)
        run["command"] = " ".join(cmd)
        result["runs"][name] = run
        longest = max(longest, wall)
        print(f"{name}: {json.dumps({k: v for k, v in run.items() if k not in ('reports', 'command')})}", flush=True)
        result["table"] = table(result["runs"])
        result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        save(out, result)
    result["table"] = table(result["runs"])
    save(out, result)
    print_table(result["runs"], result["table"])
    print(f"results: {out}" + (" (incomplete: rerun the same command)" if stopped else ""), flush=True)
    if stopped:
        sys.exit(3)


if __name__ == "__main__":
    main()
