"""Benchmark of `dflash extract` on random targets of real shapes that are not plain attention stacks, beside the
model's own truncated forward over the same token batches in the same run.

    source bench/device_env.sh && python3 bench/targets.py --work /tmp/bt [--case qwen36_27b,gpt_oss_20b]
    python3 bench/targets.py --smoke --work /tmp/bt-smoke        # the same path on the CPU, tiny shapes first

Cases (--layers auto, bf16, one GPU):
  qwen36_27b:  Qwen3.6-27B-shaped qwen3_5 text model: hidden 5,120, 64 layers of 16 x [3 Gated DeltaNet
               linear_attention + 1 gated full_attention], 24/4 heads of dim 256, partial rotary 0.25,
               intermediate 17,408, vocab 248,320 (linear attention: 16 key / 48 value heads of dim 128, conv 4);
               layers auto = [1, 16, 31, 46, 61], so the command runs 62 layers;
  gpt_oss_20b: gpt-oss-20b-shaped: hidden 2,880, 24 layers alternating sliding (128) and full attention with
               sinks (flex attention on CUDA, eager on the CPU: no SDPA kernel takes sinks), 64/8 heads of dim 64,
               32 experts top-4 of width 2,880, vocab 201,088.
Each case runs
  (1) `dflash extract --gpus 0` as a subprocess (this script with --child: the command's own entry point, with
      target.load.load_for_features replaced by a random init on the GPU in the product's attention choice and
      the weight check skipped;
      the folder holds the config, the test tokenizer and a one-tensor weights file for the fingerprint: writing
      and reading 54 GB of random weights would measure the disk only); from its summary the steady tok/s (first
      forward to last commit, every byte on disk) and from its log which Gated DeltaNet path ran;
  (2) the model's own truncated forward (TargetRunner.hidden: the text model's forward cut after the deepest
      captured layer, no self-check) over exactly the batches the command ran, in this process, twice (cold, warm);
and prints steady / forward (the issue asks >= 0.9 of the forward) and the tok/s per GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import extract as bx  # noqa: E402  (bench/extract.py: the command runner, the data, the truncated forward)

_LIN, _FULL, _SLIDE = "linear_attention", "full_attention", "sliding_attention"
CASES = {
    "qwen36_27b": ("qwen3_5_text", dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, layer_types=[_LIN, _LIN, _LIN, _FULL] * 16, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "gpt_oss_20b": ("gpt_oss", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=[_SLIDE, _FULL] * 12, max_position_embeddings=131072, tie_word_embeddings=False)),
}
# --smoke: the same kinds at a size a CPU runs in seconds (8 layers: --layers auto needs 8).
SMOKE = {
    "qwen36_27b": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       layer_types=[_LIN, _LIN, _LIN, _FULL] * 2, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096),
    "gpt_oss_20b": dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=32, layer_types=[_SLIDE, _FULL] * 4,
                        max_position_embeddings=4096),
}


def random_target(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> object:
    """Return a random-init causal LM of the folder's config on `device` in `dtype`, in the attention
    implementation extract loads it with (target.adapter.attention_for; the command's self-check then keeps it
    or falls back, targets/kernels.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.targets.adapter import attention_for

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=attention_for(config, device))
    return model.eval()


def make_folder(folder: Path, model_type: str, config: dict) -> None:
    """Write a target folder: the config, the test tokenizer (one token per character) and a one-tensor weights
    file (the command fingerprints the folder's weight files; the weights themselves are made on the GPU)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from dflash.tests.tiny_targets import build_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(model_type, **config).save_pretrained(folder)
    build_tokenizer("chatml").save_pretrained(folder)
    save_file({"placeholder": torch.zeros(1)}, str(folder / "model.safetensors"))


def prepare_case(name: str, case: tuple[str, dict], smoke: dict | None, args: argparse.Namespace) -> tuple:
    """Return (the case's work folder, its target folder, the conversations) made for a case (model type,
    config), its config overridden by `smoke` where given."""
    model_type, config = case
    work = args.work / name
    folder, data = work / "target", args.work / f"conversations-{args.tokens}.jsonl"
    make_folder(folder, model_type, {**config, **(smoke or {})})
    bx.make_conversations(data, args.tokens)
    return work, folder, data


def skip_weight_check() -> None:
    """Skip the command's weight check of a bench's target folder (its one-tensor file is not the random model's):
    in targets/weights.py, which owns it, and in targets/load.py, which took the name at import."""
    import dflash.targets.load as loading
    import dflash.targets.weights as weights

    weights.check_weights = loading.check_weights = lambda path, **kw: None


def child(argv: list[str]) -> None:
    """Run the `dflash` entry point with the target's load replaced by random_target and its weight check (against
    the folder's one-tensor file) skipped (what --child does)."""
    import dflash.targets.load as loading
    from dflash.cli import main

    loading.load_for_features = random_target
    skip_weight_check()
    if os.environ.get("BENCH_SWITCH_INTERVAL"):  # a --variants probe: the interpreter's GIL hand-over interval
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
    if os.environ.get("BENCH_DYNAMIC_FIRST") == "1":  # a --variants probe: torch.compile's first graph of a function
        # takes every size as symbolic (transformers' compiled flex attention and block masks compile once for all
        # batch shapes, not once static and again dynamic at the next shape)
        torch._dynamo.config.assume_static_by_default = False
    if os.environ.get("BENCH_STACKS"):  # the main thread's stack every BENCH_STACKS seconds, into the command's log:
        # where a start-up that a limit cuts spends its time (faulthandler's dump_traceback_later, tried first,
        # crashed the process inside torch.compile on the CPU)
        import threading
        import traceback

        def stacks(every: float, main: int) -> None:
            while True:
                time.sleep(every)
                frame = sys._current_frames().get(main)
                if frame is not None:
                    print(f"[bench stack {time.strftime('%H:%M:%S')}]\n" + "".join(traceback.format_stack(frame)[-25:]),
                          file=sys.stderr, flush=True)

        threading.Thread(target=stacks, args=(float(os.environ["BENCH_STACKS"]), threading.get_ident()),
                         daemon=True).start()
    if os.environ.get("BENCH_FIRST_CALL_CHECK") == "1":  # a --variants probe: the compiled layers' first call on the
        # self-check's 2 rows of ~96 tokens, as before kernels.warm_forward (inductor's size hints and Triton's
        # first-launch tuning from that call, not from a batch of the run's size)
        import dflash.targets.kernels as kernels

        kernels.warm_forward = lambda text, shape: None
    if os.environ.get("BENCH_ONE_ROW") == "1":  # a --variants probe: a batch of one row on flex attention runs as
        # one row, as before targets/runner.py ran it as two (torch.compile compiled flex again for a size of 1)
        from dflash.targets.runner import TargetRunner

        TargetRunner.one_row_as_two = False
    if os.environ.get("BENCH_STATIC_FIRST") == "1":  # a --variants probe: flex's first graphs static, torch's
        # default, as before kernels.dynamic_first (a second, dynamic round at the first batch of another shape)
        import dflash.targets.kernels as kernels

        kernels.dynamic_first = lambda device: False
    if os.environ.get("BENCH_NO_CUDNN") == "1":  # a --variants probe: the command as before targets/attention.py
        # (SDPA's flash or memory-efficient kernel for full attention), on the same machine
        import dflash.targets.attention as attention

        attention.usable = lambda device: False
    main(argv)


def triton_kernels() -> int:
    """Return how many kernels Triton's on-disk cache holds (a run's compiles are the difference before/after)."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return sum(1 for _ in cache.iterdir()) if cache.is_dir() else 0


def autotuning(log: str) -> dict:
    """Return, per Triton kernel, how many autotunings the log shows (TRITON_PRINT_AUTOTUNING=1), their seconds and
    keys: which argument of the batch made a kernel tune again."""
    seen: dict = {}
    for fn, key, secs in re.findall(r"Triton autotuning for function (\w+),\s*with key as (.*?),\s*finished after "
                                    r"([\d.]+)s", log, re.S):
        entry = seen.setdefault(fn, {"n": 0, "s": 0.0, "keys": []})
        entry["n"] += 1
        entry["s"] = round(entry["s"] + float(secs), 2)
        if len(entry["keys"]) < 6:
            entry["keys"].append(key)
    return dict(sorted(seen.items(), key=lambda kv: -kv[1]["s"]))


def extract_run(folder: Path, data: Path, work: Path, gpus: str, flags: list[str], tag: str) -> tuple[dict, dict]:
    """Run the command once; return its figures and what it compiled and autotuned."""
    before = triton_kernels()
    log = work / f"extract{tag}.log"
    cmd = bx.run_command(folder, data, work / "store", gpus, ["--dtype", "bfloat16", *flags], log,
                         profile=work / f"profile{tag}.json", entry=[str(Path(__file__).resolve()), "--child"])
    tuned = autotuning(log.read_text())
    compiled = {"triton_kernels_compiled": triton_kernels() - before,
                "autotunings": sum(v["n"] for v in tuned.values()),
                "autotune_s": round(sum(v["s"] for v in tuned.values()), 1), "autotuned": tuned}
    print(f"run{tag or ' 1'}: {json.dumps(compiled)}", flush=True)
    return cmd, compiled


def run_case(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Return the command's and the forward's figures of one case."""
    from dflash.storage import Store

    work, folder, data = prepare_case(name, CASES[name], SMOKE[name] if args.smoke else None, args)
    gpus = "cpu" if args.smoke else "0"
    cmd, compiled = extract_run(folder, data, work, gpus, [], "")
    log = (work / "extract.log").read_text()
    gdn = [line.split(": ", 1)[-1] for line in log.splitlines() if "Gated DeltaNet layers run" in line]
    bf16 = torch.bfloat16
    fwd = bx.truncated_forward(folder, data, work / "store", device, load=lambda: random_target(folder, device, bf16))
    header = Store.open(str(work / "store")).header
    out = {"case": name, "layer_ids": header["layer_ids"], "gated_deltanet": gdn[0] if gdn else None,
           "command": {k: cmd[k] for k in ("wall_s", "tokens", "load_s", "steady_tok_s", "forward_side_tok_s")},
           "forward": {k: fwd[k] for k in ("tokens", "batches", "tok_s", "warm_tok_s", "best_tok_s")},
           "first_run_compiles": compiled}
    out["steady_over_forward"] = round(cmd["steady_tok_s"] / fwd["tok_s"], 3)
    out["steady_over_best_forward"] = round(cmd["steady_tok_s"] / fwd["best_tok_s"], 3)
    if cmd["timeline"] is not None:
        print(bx.timeline_totals(cmd["timeline"]), flush=True)
    if args.variants:
        out["variants"] = run_variants(folder, data, work, gpus, args.variants, fwd["tok_s"])
    return out


def run_variants(folder: Path, data: Path, work: Path, gpus: str, variants: str, forward_tok_s: float,
                 flags: list[str] | None = None, compare: Any = None) -> list[dict]:
    """Run the command again once per ';'-separated variant, to find where its time goes beside the same forward:
    each variant's words are extra extract flags, or NAME=VALUE set in the command's environment (SWITCH=s: the
    interpreter's GIL hand-over interval in seconds; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching
    allocator's mode). Return each run's figures (printed as it ends), its steady tok/s over forward_tok_s, and
    compare(its --profile timeline) where given (bench/forward_kernels.py: its forwards batch by batch)."""
    out = []
    for variant in filter(None, variants.split(";")):
        words = variant.split()
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
        if "SWITCH" in env:
            env["BENCH_SWITCH_INTERVAL"] = env.pop("SWITCH")
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            again, compiled = extract_run(folder, data, work, gpus,
                                          [*(flags or []), *(w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w))],
                                          f"-variant{len(out) + 1}")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out.append({"variant": variant, "steady_tok_s": again["steady_tok_s"], "wall_s": round(again["wall_s"], 1),
                    "steady_over_forward": round(again["steady_tok_s"] / forward_tok_s, 3),
                    "triton_kernels_compiled": compiled["triton_kernels_compiled"],
                    "autotunings": compiled["autotunings"], "autotune_s": compiled["autotune_s"]})
        if compare is not None:
            out[-1]["batch_by_batch"] = compare(again["timeline"])
        print(json.dumps(out[-1]), flush=True)
        if again["timeline"] is not None:
            print(bx.timeline_totals(again["timeline"]), flush=True)
    return out


def run_cases(run_case: Any, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Return run_case(name, args, device) of every --case, each printed as it ends with its seconds."""
    results = []
    for name in args.case.split(","):
        t0 = time.perf_counter()
        r = run_case(name, args, device)
        r["case_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(json.dumps(r), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("bench-targets-out"))
    ap.add_argument("--case", default="qwen36_27b,gpt_oss_20b", help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--tokens", type=int, default=300_000, help="tokens of conversations per case")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (check the script first)")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--variants", default=None, help="';'-separated reruns of the command after the forward: extra "
                    "extract flags and NAME=VALUE in its environment (run_variants), e.g. "
                    "'--writer-threads 1;SWITCH=0.0002;PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True'")
    ap.add_argument("--tuning-log", action="store_true", help="TRITON_PRINT_AUTOTUNING=1 in the command: count "
                    "the autotunings of each run and the keys that set them off")
    args = ap.parse_args()
    if args.tuning_log:
        os.environ["TRITON_PRINT_AUTOTUNING"] = "1"
    if args.smoke:
        args.tokens = min(args.tokens, 20_000)
    device = torch.device("cpu" if args.smoke else "cuda:0")
    from dflash.targets.adapter import linear_attention_path

    print(f"flash-linear-attention: {linear_attention_path() or 'not installed (torch fallback)'}", flush=True)
    results = run_cases(run_case, args, device)
    for r in results:
        c, f = r["command"], r["forward"]
        print(f"{r['case']}: layers {r['layer_ids']}; extract steady {c['steady_tok_s']:,.0f} tok/s (one GPU), "
              f"own truncated forward {f['tok_s']:,.0f} cold / {f['warm_tok_s']:,.0f} warm tok/s; "
              f"steady / forward {r['steady_over_forward']} (/ best {r['steady_over_best_forward']}); "
              f"Gated DeltaNet: {r['gated_deltanet'] or 'none in this target'}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
