"""The product's topology in miniature: `dflash extract` and `dflash train --follow` at once on one store, both
SIGKILLed mid-way and rerun; prints (and writes under $OUT) a JSON summary.

    source bench/device_env.sh && python3 bench/topology.py --extract-gpus 0 --train-gpus 0
    python3 bench/topology.py --device cpu          # tiny target on the CPU: checks the script in seconds

Issue 8's run shrunk to the GPUs at hand (on one GPU both stages share GPU 0):
  1. a random-init Qwen3-8B-config target folder on the local disk (bf16 safetensors, built on the GPU; the byte-level
     test tokenizer, vocab_size 151,936 so the mask token is the first unused row) and synthetic conversations of
     200-4000 tokens, about --tokens in all;
  2. `dflash extract --gpus E` starts; at its first commit `dflash train --gpus T --follow --draft-layers 5
     --max-steps N --save-every K` starts; nvidia-smi is sampled every second;
  3. extract is SIGKILLed once --kill-at of its shards are committed (and enough data for K+2 steps is there), train
     once its first checkpoint is complete; both are then rerun with the same commands (`--resume` for train);
  4. `dflash verify STORE` must exit 0, and the train steps in RUN/metrics.jsonl must run 1..N without a gap or a
     repeat, the second run starting right after the checkpoint it resumed from.
Reported: extract tokens/s (total and per GPU) and store GB/s written, train tokens/s and data wait, whether training
waited on extraction, GPU utilisation per GPU (all of the run, and while both stages ran), the kill points.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

# NVLink multicast stays off in every child (the lent machines' fabric does not support it: KINDS.md).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
WORDS = ("the a model token layer block draft target cache shard store verify batch length answer because which "
         "therefore compute memory disk").split()
WAITING = "waiting for `dflash extract`:"


class Overrun(RuntimeError):
    """The run went past --budget-s or a stage failed; the summary is still written."""


# ---------------------------------------------------------------------------------------------------------- inputs
def make_target(folder: Path, device: str) -> dict[str, Any]:
    """Write the target folder (model + tokenizer) and return its facts (layers, hidden size, vocab, tokenizer size)."""
    import torch

    from dflash.tests.tiny_targets import QWEN3_8B_CONFIG, build_tiny_target, build_tokenizer

    if device == "cpu":
        build_tiny_target(folder, "qwen3")
        from transformers import AutoConfig, AutoTokenizer

        cfg = AutoConfig.from_pretrained(folder)
        return {"num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "tokenizer_size": len(AutoTokenizer.from_pretrained(folder)), "params": None}
    from dflash.bench.extract import build_target

    tok = build_tokenizer("chatml")
    # The test tokenizer has a few hundred tokens: vocab_size > len(tokenizer), so the mask token is the first
    # unused row, as on the real Qwen3-8B (151,669).
    config = {**QWEN3_8B_CONFIG, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.pad_token_id}
    model = build_target(torch.device(device), config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)  # bf16 safetensors
    tok.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return {"num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
            "vocab_size": config["vocab_size"], "tokenizer_size": len(tok), "params": params}


def write_conversations(path: Path, tokens: int, seed: int = 0) -> dict[str, int]:
    """Write ~tokens tokens of ChatML conversations (200-4000 tokens each) as JSONL; return rows and tokens."""
    from dflash.bench.extract import synthetic_samples

    rng = np.random.default_rng(seed)
    # The byte-level test tokenizer makes one token of every character: a text of n characters is n tokens.
    lengths = [min(4000, max(200, len(s.input_ids))) for s in synthetic_samples(tokens, 4000, seed)]
    pool = " ".join(rng.choice(WORDS, size=4000 * 2))

    def text(n: int) -> str:
        start = int(rng.integers(0, len(pool) - n))
        return pool[start:start + n]

    with open(path, "w") as f:
        for t in lengths:
            body = t - 20  # the template's role headers and end tokens
            prompt = body // 3
            f.write(json.dumps({"messages": [{"role": "user", "content": text(prompt)},
                                             {"role": "assistant", "content": text(body - prompt)}]}) + "\n")
    return {"rows": len(lengths), "tokens": sum(lengths)}


def fit_disk(folder: Path, facts: dict[str, Any], tokens: int, draft_layers: int, min_tokens: int) -> dict[str, Any]:
    """Return the tokens to extract (--tokens, or fewer so store + two checkpoints fit the free disk) and the sums."""
    H, L = facts["hidden_size"], 5
    q, kv, inter = 32 * 128, 8 * 128, 12288  # Qwen3-8B attention and MLP widths
    draft = draft_layers * (2 * H * q + 2 * H * kv + 3 * H * inter) + L * H * H
    checkpoints = 2 * draft * 12  # fp32 weights + Adam moments; --keep 1 holds two while the newer one is written
    per_token = L * H * 2 * 0.72  # blosc keeps ~0.7 of raw bf16 (Storage section of RESULTS.md)
    free = shutil.disk_usage(folder).free  # the target is already written
    fit = int((0.85 * free - checkpoints) / per_token)
    if fit < min_tokens:
        raise Overrun(f"{folder}: {free / 1e9:.0f} GB free holds two {checkpoints / 2e9:.1f} GB checkpoints and "
                         f"{max(fit, 0):,} tokens of features, fewer than the {min_tokens:,} the run needs; pass --dir on "
                         "a larger disk")
    used = min(tokens, fit)
    return {"free_gb": free / 1e9, "need_gb": (checkpoints + used * per_token) / 1e9, "tokens": used,
            "tokens_cut_to_fit": used < tokens}


# ------------------------------------------------------------------------------------------------------- processes
class Child:
    """One `dflash` subprocess in its own session, logging to a file; remembers when it started and ended."""

    def __init__(self, name: str, argv: list[str], log: Path, t0: float) -> None:
        self.name, self.argv, self.log, self.t0 = name, argv, log, t0
        self.file = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--log-level", "info", *argv],
                                     stdout=self.file, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **CHILD_ENV})
        self.start, self.end, self.killed = time.monotonic() - t0, None, False

    def alive(self) -> bool:
        if self.end is None and self.proc.poll() is not None:
            self.end = time.monotonic() - self.t0
            self.file.close()
        return self.end is None

    def sigkill(self) -> None:
        """SIGKILL the child's whole process group (its spawned workers too) and reap it."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.killed = True
            self.alive()

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def record(self) -> dict[str, Any]:
        self.alive()
        return {"start_s": round(self.start, 1), "end_s": None if self.end is None else round(self.end, 1),
                "killed": self.killed, "returncode": self.proc.returncode}


class Sampler(threading.Thread):
    """Samples nvidia-smi utilisation and memory of every GPU once per interval into self.rows."""

    def __init__(self, t0: float, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.t0, self.interval, self.rows, self.stop = t0, interval, [], threading.Event()

    def run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
        while not self.stop.is_set():
            t = time.monotonic() - self.t0
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.strip().splitlines():
                idx, util, mem = (int(x) for x in line.split(","))
                self.rows.append((t, idx, util, mem))
            self.stop.wait(self.interval)


def commits(store: Path) -> int:
    folder = store / "commits"
    return len(list(folder.glob("*.json"))) if folder.is_dir() else 0


def checkpoint_step(run: Path) -> int | None:
    """Return the newest complete checkpoint's step of a run, or None."""
    from dflash.drafter.folders import newest_sound

    folder = newest_sound(run / "checkpoints") if (run / "checkpoints").is_dir() else None
    return int(folder.name.split("-")[1]) if folder is not None else None


# -------------------------------------------------------------------------------------------------------- figures
def extract_figures(store: Path, runs: list[tuple[float, float]], t0_wall: float, gpus: int) -> list[dict[str, Any]]:
    """Return per extract run: tokens, bytes, tokens/s and GB/s written (from its start, and between its commits)."""
    from dflash.storage import Store

    s = Store.open(str(store))
    recs = [s.commit_record(i) for i in s.committed_ids()]
    out = []
    for start, end in runs:
        mine = sorted((r for r in recs if start <= r["time"] - t0_wall <= end), key=lambda r: r["time"])
        if not mine:
            out.append({"shards": 0})
            continue
        times = [r["time"] - t0_wall for r in mine]
        tok, nbytes = sum(r["num_tokens"] for r in mine), sum(r["bytes"] for r in mine)
        fig = {"shards": len(mine), "tokens": tok, "bytes": nbytes, "first_commit_s": round(times[0], 1),
               "last_commit_s": round(times[-1], 1), "tok_s_from_start": tok / (times[-1] - start),
               "gb_s_from_start": nbytes / (times[-1] - start) / 1e9}
        if len(mine) > 1:  # steady state: the shards after the first, over the time between first and last commit
            span = times[-1] - times[0]
            fig["tok_s_steady"] = sum(r["num_tokens"] for r in mine[1:]) / span
            fig["tok_s_steady_per_gpu"] = fig["tok_s_steady"] / gpus
            fig["gb_s_written_steady"] = sum(r["bytes"] for r in mine[1:]) / span / 1e9
        out.append(fig)
    return out


def train_figures(records: list[dict[str, Any]], first: int, last: int, log: Path) -> dict[str, Any]:
    """Return the step range, median tokens/s (first step left out), data wait and waits of one train run."""
    steps = [r for r in records if r.get("split") == "train" and first <= r["step"] <= last]
    timed = steps[1:] or steps
    return {"steps": [steps[0]["step"], steps[-1]["step"]] if steps else None,
            "tok_s_median": float(np.median([r["tokens_per_s"] for r in timed])) if timed else None,
            "data_wait_mean": float(np.mean([r["data_wait"] for r in timed])) if timed else None,
            "data_wait_max": float(max(r["data_wait"] for r in timed)) if timed else None,
            "waiting_lines": log.read_text(errors="replace").count(WAITING) if log.exists() else 0}


def util_figures(rows: list[tuple], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Return mean/max utilisation and peak memory per GPU over all samples and over the windows."""
    out: dict[str, Any] = {}
    for idx in sorted({r[1] for r in rows}):
        mine = [r for r in rows if r[1] == idx]
        inside = [r for r in mine if any(a <= r[0] <= b for a, b in windows)]
        out[str(idx)] = {
            "samples": len(mine), "util_mean": float(np.mean([r[2] for r in mine])), "util_max": max(r[2] for r in mine),
            "mem_max_gib": max(r[3] for r in mine) / 1024,
            "both_running_samples": len(inside),
            "both_running_util_mean": float(np.mean([r[2] for r in inside])) if inside else None}
    return out


def overlap(a: Child, b: Child, now: float) -> tuple[float, float] | None:
    lo, hi = max(a.start, b.start), min(a.end if a.end is not None else now, b.end if b.end is not None else now)
    return (lo, hi) if hi > lo else None


# ------------------------------------------------------------------------------------------------------------ run
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--extract-gpus", default="0", help="--gpus of `dflash extract` (ignored with --device cpu)")
    ap.add_argument("--train-gpus", default="0", help="--gpus of `dflash train` (ignored with --device cpu)")
    ap.add_argument("--tokens", type=int, default=None, help="conversation tokens [cuda 300,000, fewer if the disk is short; cpu 40,000]")
    ap.add_argument("--shards", type=int, default=8, help="shards in the store's plan")
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of shards committed when extract is killed")
    ap.add_argument("--attention", default="auto", help="train --attention (sdpa at 16K tokens a step ran out of an "
                    "H200's memory beside the 8B target; flex peaks at ~76 GB)")
    ap.add_argument("--train-batch-tokens", type=int, default=None, help="train --batch-tokens [cuda 16384; cpu 2048]")
    ap.add_argument("--dir", default=None, help="work folder on the local disk [cuda: a new folder here; cpu: /tmp]")
    ap.add_argument("--keep-dir", action="store_true", help="keep the work folder (target, store, run)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop and report after this long [cuda 230; cpu 120]")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    tokens = args.tokens or (40_000 if cpu else 300_000)
    budget = args.budget_s or (120.0 if cpu else 230.0)
    if args.max_steps <= args.save_every:
        raise SystemExit(f"--max-steps {args.max_steps} must exceed --save-every {args.save_every}: the run is killed "
                         "after its first checkpoint and resumed from it")
    egpus, tgpus = ("cpu", "cpu") if cpu else (args.extract_gpus, args.train_gpus)
    attention = args.attention
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dflash-topology-", dir=None if cpu else "."))
    work.mkdir(parents=True, exist_ok=True)
    target, data, store, run = work / "target", work / "conversations.jsonl", work / "store", work / "run"
    for p in (store, run):
        shutil.rmtree(p, ignore_errors=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    t0, t0_wall = time.monotonic(), time.time()
    deadline = t0 + budget
    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": sys.argv,
                               "ok": False, "events": {}}
    ev = summary["events"]
    children: list[Child] = []
    sampler = None if cpu or shutil.which("nvidia-smi") is None else Sampler(t0)

    def mark(name: str) -> None:
        ev[name] = round(time.monotonic() - t0, 1)
        print(f"[{ev[name]:6.1f} s] {name}", flush=True)

    def poll(what: str, ready, *watch: Child, step: float = 0.05) -> None:
        """Wait until ready() holds; a watched child that exits non-zero, or the budget running out, is an error."""
        while not ready():
            for c in watch:
                if not c.alive() and c.proc.returncode not in (0, -signal.SIGKILL) and not c.killed:
                    raise Overrun(f"{c.name} exited with {c.proc.returncode} while waiting for {what}:\n{c.tail()}")
            if time.monotonic() > deadline:
                raise Overrun(f"--budget-s {budget:.0f} ran out while waiting for {what}")
            time.sleep(step)

    try:
        facts = make_target(target, "cpu" if cpu else "cuda")
        mark("target_written")
        batch_tokens = args.train_batch_tokens or (2048 if cpu else 16384)
        if not cpu:
            summary["disk"] = fit_disk(work, facts, tokens, 5, 2 * (args.save_every + 2) * batch_tokens)
            tokens = summary["disk"]["tokens"]
        summary["data"] = write_conversations(data, tokens)
        rows = summary["data"]["rows"]
        shard_rows = math.ceil(rows / args.shards)
        ext = ["extract", "--model", str(target), "--data", str(data), "--out", str(store), "--gpus", egpus,
               "--shard-size", str(shard_rows)]
        trn = ["train", "--store", str(store), "--target", str(target), "--out", str(run), "--gpus", tgpus, "--follow",
               "--draft-layers", "5", "--max-steps", str(args.max_steps), "--save-every", str(args.save_every),
               "--keep", "1", "--log-every", "1", "--attention", attention, "--batch-tokens", str(batch_tokens)]
        if cpu:
            ext += ["--dtype", "float32", "--batch-tokens", "8192"]
            trn += ["--dtype", "float32", "--anchors", "64"]
        summary.update(extract_command="dflash " + " ".join(ext), train_command="dflash " + " ".join(trn))
        if sampler is not None:
            sampler.start()

        # Phase 1: extract, then train as soon as the first shard commits; kill each mid-way.
        e1 = Child("extract-1", ext, logs / "extract-1.log", t0)
        children.append(e1)
        mark("extract_1_started")
        poll("the first commit", lambda: commits(store) >= 1 or not e1.alive(), e1)
        if commits(store) < 1:
            raise Overrun(f"extract-1 ended without a commit:\n{e1.tail()}")
        mark("first_commit")
        t1 = Child("train-1", trn, logs / "train-1.log", t0)
        children.append(t1)
        from dflash.storage import Store

        num_shards = Store.open(str(store)).num_shards
        kill_shards = max(1, math.ceil(args.kill_at * num_shards))

        def committed_tokens() -> int:
            s = Store.open(str(store))
            return sum(s.commit_record(i)["num_tokens"] for i in s.committed_ids())

        need_tokens = (args.save_every + 2) * batch_tokens  # the killed trainer must reach its checkpoint
        kills: dict[str, Any] = {"num_shards": num_shards}
        while e1.alive() or t1.alive():
            if time.monotonic() > deadline:
                raise Overrun(f"--budget-s {budget:.0f} ran out in phase 1")
            if e1.alive() and commits(store) >= kill_shards and committed_tokens() >= need_tokens:
                e1.sigkill()
                kills["extract_killed_at_commits"] = commits(store)
                mark("extract_1_killed")
            if t1.alive() and checkpoint_step(run) is not None:
                t1.sigkill()
                mark("train_1_killed")
            for c in (e1, t1):
                if not c.alive() and not c.killed and c.proc.returncode != 0:
                    raise Overrun(f"{c.name} exited with {c.proc.returncode}:\n{c.tail()}")
            if not t1.alive() and not t1.killed:
                raise Overrun(f"train-1 ended before it could be killed after a checkpoint:\n{t1.tail()}")
            time.sleep(0.05)
        if not t1.killed:  # it ended between two polls: a crash (an OOM, say), not the checkpoint it was waiting for
            raise Overrun(f"train-1 exited with {t1.proc.returncode} before its first checkpoint:\n{t1.tail()}")
        from dflash.train.metrics import read_metrics

        kills["extract_interrupted"] = e1.killed
        kills["extract_commits_before_rerun"] = commits(store)
        kills["train_checkpoint_step"] = ckpt = checkpoint_step(run)
        steps_1 = [r["step"] for r in read_metrics(run) if r.get("split") == "train"]
        kills["train_last_logged_step"] = max(steps_1) if steps_1 else None
        summary["kills"] = kills
        metrics_1 = read_metrics(run)

        # Phase 2: the same commands again, --resume for train.
        e2 = Child("extract-2", ext, logs / "extract-2.log", t0)
        t2 = Child("train-2", trn + ["--resume"], logs / "train-2.log", t0)
        children += [e2, t2]
        mark("rerun_started")
        poll("the reruns", lambda: not e2.alive() and not t2.alive(), e2, t2, step=0.2)
        mark("reruns_done")
        for c in (e2, t2):
            if c.proc.returncode != 0:
                raise Overrun(f"{c.name} exited with {c.proc.returncode}:\n{c.tail()}")
        verify = subprocess.run([sys.executable, "-m", "dflash.cli", "verify", str(store)], capture_output=True,
                                text=True, env={**os.environ, **CHILD_ENV})
        mark("verified")

        # Figures and checks.
        records = read_metrics(run)
        steps = [r["step"] for r in records if r.get("split") == "train"]
        resumed = re.search(r"resumed \S+ at step (\d+)", t2.log.read_text(errors="replace"))
        s = Store.open(str(store))
        header = s.header
        end = time.monotonic() - t0
        summary["extract"] = {"gpus": egpus, "runs": extract_figures(store, [(e1.start, e1.end), (e2.start, e2.end)],
                                                                       t0_wall, len(egpus.split(",")))}
        total = {k: sum(r.get(k, 0) for r in summary["extract"]["runs"]) for k in ("shards", "tokens", "bytes")}
        summary["store"] = {**total, "complete": s.is_complete(), "bytes_per_token": total["bytes"] / total["tokens"],
                            "raw_bytes_per_token": len(header["layer_ids"]) * header["hidden_size"] * 2,
                            "layer_ids": header["layer_ids"], "mask_token_id": header["mask_token_id"],
                            "mask_is_first_unused_row": header["mask_token_id"] == facts["tokenizer_size"]}
        tr1 = train_figures(metrics_1, 1, ckpt or 0, t1.log)
        tr2 = train_figures(records, (ckpt or 0) + 1, args.max_steps, t2.log)
        for tr in (tr1, tr2):
            if tr["tok_s_median"] is not None:
                tr["store_read_gb_s_est"] = tr["tok_s_median"] * summary["store"]["bytes_per_token"] / 1e9
        summary["train"] = {"gpus": tgpus, "attention": attention, "batch_tokens": batch_tokens, "runs": [tr1, tr2],
                            "waited_on_extraction": any(t["waiting_lines"] > 0 or (t["data_wait_max"] or 0) > 0.05
                                                        for t in (tr1, tr2))}
        windows = [w for w in (overlap(e1, t1, end), overlap(e2, t2, end)) if w]
        summary["both_running_s"] = round(sum(b - a for a, b in windows), 1)
        summary["processes"] = {c.name: c.record() for c in children}
        summary["resume"] = {
            "verify_returncode": verify.returncode, "verify_output": (verify.stdout + verify.stderr)[-500:],
            "checkpoint_step": ckpt, "resumed_at_step": int(resumed.group(1)) if resumed else None,
            "steps_logged": [min(steps), max(steps)] if steps else None,
            "steps_continuous": steps == list(range(1, args.max_steps + 1)),
        }
        r = summary["resume"]
        summary["ok"] = bool(verify.returncode == 0 and r["resumed_at_step"] == ckpt and ckpt is not None
                             and r["steps_continuous"] and summary["store"]["complete"])
    except Overrun as e:
        summary["error"] = str(e)
        print(f"error: {e}", file=sys.stderr, flush=True)
    finally:
        for c in children:
            c.sigkill()
        if sampler is not None:
            sampler.stop.set()
            sampler.join(timeout=15)
            pairs = [(children[i], children[i + 1]) for i in range(0, len(children) - 1, 2)]  # (extract, train)
            now = time.monotonic() - t0
            both = [w for w in (overlap(a, b, now) for a, b in pairs) if w]
            summary["gpu"] = util_figures(sampler.rows, both) if sampler.rows else None
        summary["machine"] = machine()
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        text = json.dumps(summary, indent=2, default=float)
        print(text, flush=True)
        if os.environ.get("OUT"):
            out = Path(os.environ["OUT"])
            (out / "topology.json").write_text(text + "\n")
            for log in sorted(logs.glob("*.log")):
                (out / log.name).write_text(log.read_text(errors="replace")[-2_000_000:])
            if (run / "metrics.jsonl").exists():
                shutil.copy(run / "metrics.jsonl", out / "metrics.jsonl")
        if not args.keep_dir:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if summary["ok"] else 1)


def machine() -> str:
    """Return the GPU name (or cpu), the CPU count, the OS and torch's version."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return f"{gpu} x{torch.cuda.device_count()}, {os.cpu_count()} CPUs, {platform.platform()}, torch {torch.__version__}"


if __name__ == "__main__":
    main()
