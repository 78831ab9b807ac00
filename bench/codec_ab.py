"""Codec A/B of the feature store (issue 41, point 5): bytes a token and error of every codec on a target's real
features, and, with --ab on a GPU machine, measured tau of a drafter trained from a store of each codec.

    python -m dflash.bench.codec_ab --model FOLDER --smoke                 # CPU: bytes a token and error only
    python -m dflash.bench.codec_ab --model FOLDER --data CONV.jsonl --prompts P.jsonl --ab --work /scratch/ab \
        [--codecs blosc,fp8,bf16m3] [--extract-args "..."] [--train-args "..."]

--ab runs, per codec, `dflash extract --codec C`, `dflash train` and `dflash eval --prompts` (measured tau by
speculative decoding) with the same data, seeds and options, and prints one table: stored bytes a token (and x raw
bf16) beside measured tau (and x the first codec's). The default codec changes only on such a table (issue 41:
fewest bytes with measured tau within 1% of blosc's).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np


def features(model_dir: str, texts: list[str], max_tokens: int, device: str) -> tuple[np.ndarray, list[int]]:
    """Return (bf16 bits [T, 5, H] of the target's DFlash layers on the texts, the layer ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.facts import NUM_FEATURE_LAYERS, build_target_layer_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids = build_target_layer_ids(model.config.num_hidden_layers, NUM_FEATURE_LAYERS)
    out, total = [], 0
    with torch.no_grad():
        for text in texts:
            enc = tok(text, return_tensors="pt", truncation=True, max_length=1024).to(device)
            hs = model(**enc, output_hidden_states=True).hidden_states
            f = torch.stack([hs[i + 1][0] for i in ids], dim=1).to(torch.bfloat16).cpu()
            out.append(f.view(torch.int16).numpy().view(np.uint16))
            total += f.shape[0]
            if total >= max_tokens:
                break
    return np.concatenate(out)[:max_tokens], ids


def measure(bits: np.ndarray, codecs: list[str], chunk: int = 512) -> list[dict]:
    """Return per codec: stored bytes a token (whole chunks, as the writer encodes them), x raw, relative error."""
    import torch

    from dflash.extract.dry_run import _encoded_bytes
    from dflash.storage.codec import TRIM_BITS, fp8_to_bf16_bits, to_fp8, trim_mantissa

    T = bits.shape[0] // chunk * chunk
    bits = bits[:T]
    raw = bits[0].size * 2
    ref = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    rows = []
    for codec in codecs:
        t0 = time.perf_counter()
        stored = sum(_encoded_bytes(bits[i:i + chunk], codec) for i in range(0, T, chunk))
        enc_s = time.perf_counter() - t0
        if codec == "fp8":
            q, s = to_fp8(bits)
            back = np.empty_like(bits)
            fp8_to_bf16_bits(q, s, back)
        elif codec in TRIM_BITS:
            back = trim_mantissa(bits, TRIM_BITS[codec])
        else:
            back = bits
        got = torch.from_numpy(back.view(np.int16)).view(torch.bfloat16).float()
        err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
        rows.append({"codec": codec, "bytes_per_token": stored / T, "x_raw": stored / T / raw,
                     "rel_error_mean": float(err.mean()), "rel_error_max": float(err.max()),
                     "encode_mb_s": T * raw / enc_s / 1e6})
    return rows


def ab(args: argparse.Namespace, codecs: list[str]) -> list[dict]:
    """Return per codec: its store's bytes a token and the measured tau of a drafter trained from it."""
    rows = []
    for codec in codecs:
        store, run, tau = (os.path.join(args.work, f"{x}-{codec}") for x in ("store", "run", "tau.jsonl"))
        dflash = [sys.executable, "-m", "dflash.cli"]
        subprocess.run([*dflash, "extract", "--model", args.model, "--data", args.data, "--out", store, "--codec",
                        codec, *shlex.split(args.extract_args)], check=True)
        subprocess.run([*dflash, "train", "--store", store, "--target", args.model, "--out", run,
                        *shlex.split(args.train_args)], check=True)
        ev = subprocess.run([*dflash, "eval", "--drafter", run, "--prompts", args.prompts, "--out", tau, "--json",
                             *shlex.split(args.eval_args)], check=True, capture_output=True, text=True)
        info = json.loads(subprocess.run([*dflash, "inspect", store, "--json"], check=True, capture_output=True,
                                         text=True).stdout)
        rows.append({"codec": codec, "bytes_per_token": info["bytes_per_token"],
                     "x_raw": 1 / info["compression_ratio"], "eval": ev.stdout.strip().splitlines()[-1]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="target folder")
    p.add_argument("--codecs", default="blosc,fp8,bf16m3,bf16m2")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of real features measured (bytes and error)")
    p.add_argument("--smoke", action="store_true", help="CPU, 1,024 tokens: bytes a token and error only")
    p.add_argument("--ab", action="store_true", help="GPU: extract, train and eval per codec (measured tau)")
    p.add_argument("--data", help="--ab: conversations of extract")
    p.add_argument("--prompts", help="--ab: held-out prompts of eval (measured tau)")
    p.add_argument("--work", default="codec-ab", help="--ab: folder of the stores and runs")
    p.add_argument("--extract-args", default="--gpus 0")
    p.add_argument("--train-args", default="--gpus 0")
    p.add_argument("--eval-args", default="")
    args = p.parse_args()
    codecs = args.codecs.split(",")
    from dflash.demo.assets import prompts_path  # the demo's prompts: real, varied text

    with open(prompts_path(), encoding="utf-8") as f:
        texts = [json.dumps(json.loads(line)) for line in f if line.strip()]
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    bits, ids = features(args.model, texts, 1024 if args.smoke else args.tokens, device)
    print(f"{bits.shape[0]} tokens of layers {ids} of {args.model}")
    for r in measure(bits, codecs):
        print(f"{r['codec']:8s} {r['bytes_per_token']:10,.0f} B/token  {r['x_raw']:.3f}x raw bf16  rel. error mean "
              f"{r['rel_error_mean']:.4f} max {r['rel_error_max']:.4f}  encode {r['encode_mb_s']:,.0f} MB/s")
    if args.ab:
        for r in ab(args, codecs):
            print(json.dumps(r))


if __name__ == "__main__":
    main()
