"""Codec A/B of the feature store (issue 41, point 5): bytes a token and error of every codec on a target's real
features, and, on a finished `dflash demo` folder, measured tau of the demo's drafter trained from a store of each.

    python bench/codec_ab.py [--model FOLDER] [--smoke]          # bytes a token and error (the demo's SmolLM2)
    python bench/codec_ab.py --store DEMO_OUT/store --tokens 16384 # the same on the features a demo stored
    python bench/codec_ab.py --demo DEMO_OUT --work /tmp/ab [--codecs blosc,fp8,uq4] [--json ab.json]

--demo takes the demo's data, its store (uq6 since 2026-12-05, blosc before), its drafter and its decoding as the arm
of its store's codec; per codec it
extracts the same data again with that codec, trains the same drafter with the same settings (the demo's own stage
configs, demo.extract_config / demo.train_config), and scores it the same way: held-out tau_hat on the demo store's
held-out shards (the same features for every arm) and measured tau, speculative against greedy decoding of the
prompts the demo decoded. Prints one line per arm: stored bytes a token (x blosc, x raw bf16) beside tau_hat and
measured tau (x blosc's). Every arm resumes, so a time limit costs only what was running. The default codec changes
only on such a table (issue 41: the fewest bytes with measured tau within 1% of blosc's). On a GPU: after
`dflash demo --device cuda --out DEMO_OUT`; on the 2-core CPU after `dflash demo`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

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


def stored_features(store_dir: Path, max_tokens: int) -> np.ndarray:
    """Return the bf16 bits [T, L, H] of a lossless store's committed shards, in shard order, up to max_tokens."""
    import torch

    from dflash.storage import Store

    store = Store.open(str(store_dir))
    codec = store.header["codec"]
    if codec not in ("blosc", "none"):
        raise SystemExit(f"{store_dir}: expected a lossless store (--codec blosc or none), found --codec {codec}")
    out, total = [], 0
    for sid in store.committed_ids():
        f = store.read_shard(sid).features
        out.append(f.view(torch.int16).numpy().view(np.uint16))
        total += out[-1].shape[0]
        if total >= max_tokens:
            break
    return np.concatenate(out)[:max_tokens]


def measure(bits: np.ndarray, codecs: list[str], chunk: int = 512) -> list[dict]:
    """Return per codec: stored bytes a token (whole chunks, as the writer encodes them), x raw, relative error a
    (token, layer) row, the same without each row's largest 1% of magnitudes (the bulk: a hidden state's few huge
    channels carry most of a row's norm), and the encode and decode throughput (raw bf16 MB/s, one thread's torch)."""
    import torch

    from dflash.extract.dry_run import _encoded_bytes
    from dflash.storage.codec import SCALED_CODECS, TRIM_BITS, decode_scaled_into, encode_scaled, trim_mantissa

    T = bits.shape[0] // chunk * chunk
    bits = bits[:T]
    raw = bits[0].size * 2
    ref = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    mag = ref.abs()
    H = ref.shape[-1]
    bulk = mag < mag.kthvalue(max(1, H - H // 100), dim=-1, keepdim=True).values
    rows = []
    for codec in codecs:
        t0 = time.perf_counter()
        stored = sum(_encoded_bytes(bits[i:i + chunk], codec) for i in range(0, T, chunk))
        enc_s = time.perf_counter() - t0
        back, dec_s = bits, 0.0
        if codec in SCALED_CODECS:
            q, s = encode_scaled(bits, codec)
            back = np.empty_like(bits)
            t0 = time.perf_counter()
            decode_scaled_into(codec, q, s, back)
            dec_s = time.perf_counter() - t0
        elif codec in TRIM_BITS:
            back = trim_mantissa(bits, TRIM_BITS[codec])
        got = torch.from_numpy(back.view(np.int16)).view(torch.bfloat16).float()
        diff = got - ref
        err = diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
        err_bulk = (diff * bulk).norm(dim=-1) / (ref * bulk).norm(dim=-1).clamp_min(1e-30)
        rows.append({"codec": codec, "bytes_per_token": stored / T, "x_raw": stored / T / raw,
                     "rel_error_mean": float(err.mean()), "rel_error_max": float(err.max()),
                     "bulk_error_mean": float(err_bulk.mean()), "encode_mb_s": T * raw / enc_s / 1e6,
                     "decode_mb_s": T * raw / dec_s / 1e6 if dec_s else None})
    return rows


def store_bytes(store_dir: Path) -> dict:
    """Return a store's committed bytes, bytes a token and those over the raw bf16 features' (`dflash inspect`'s)."""
    from dflash.storage.summary import inspect_store

    info = inspect_store(str(store_dir))
    return {"store_bytes": info["bytes_on_disk"], "bytes_per_token": info["bytes_per_token"],
            "x_raw": 1 / info["compression_ratio"]}


def arms(demo_dir: Path, work: Path, codecs: list[str]) -> dict:
    """Return the A/B of the store's codecs on a finished `dflash demo` folder: its own store's arm, and per codec
    the same data extracted again with that codec, the same drafter trained from it (the demo's own stage configs),
    scored the same way (held-out tau_hat on the demo store's held-out shards, measured tau on the prompts the demo
    decoded). Every arm resumes: a rerun after a time limit continues where the last one stopped."""
    from dflash import demo
    from dflash.config import DemoConfig, EvalConfig
    from dflash.demo.assets import smollm2_folder
    from dflash.demo.data import DATA_FILE, write_held_out_prompts
    from dflash.extract import run as extract
    from dflash.runtime.process import setup_logging
    from dflash.train import run as train
    from dflash.train.evaluate import run_eval

    setup_logging("INFO")
    src, work = demo_dir.resolve(), work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    summary = json.loads((src / "summary.json").read_text())
    cfg = DemoConfig.load(src / "demo-config.json")
    budget = demo.BUDGETS[cfg.budget]
    from dflash.storage import Store

    target, data, demo_store = smollm2_folder(), src / DATA_FILE, src / "store"
    demo_codec = Store.open(str(demo_store)).header["codec"]
    gpus = "0" if cfg.device == "cuda" else "cpu"
    prompts = write_held_out_prompts(demo_store, data, src / "run", budget.decode_prompts, 1 + budget.samples,
                                     work / "decode-prompts.jsonl")

    def tau_hat(run: Path) -> float:
        return run_eval(EvalConfig(drafter=str(run), store=str(demo_store)))["tau_hat"]

    out = {demo_codec: {**store_bytes(demo_store), "tau_hat": tau_hat(src / "run"), "tau": summary["tau"],
                     "identical": summary["identical_prompts"]}}
    for codec in [c for c in codecs if c != demo_codec]:
        store, run_dir, seconds = work / f"store-{codec}", work / f"run-{codec}", {}
        t = time.perf_counter()
        extract(demo.extract_config(budget, target, data, store, gpus, codec=codec))
        seconds["extract"] = time.perf_counter() - t
        t = time.perf_counter()
        # The drafter and weights the demo trained (its saved config holds what its budget resolved to): the
        # TrainConfig defaults (DFlash 2, D-PACE) differ from the CPU budget's, so leaving them out compares drafters.
        train(demo.train_config(budget, store, target, run_dir, gpus, drafter=cfg.drafter or budget.drafter,
                                position_weights=cfg.position_weights or budget.position_weights))
        seconds["train"] = time.perf_counter() - t
        t = time.perf_counter()
        dec = demo.decode_prompts(work / f"decode-{codec}.jsonl", run_dir, target, prompts, device=cfg.device,
                                  max_new_tokens=budget.decode_tokens, numerics=demo.data_numerics(demo_store))
        seconds["decode"] = time.perf_counter() - t
        out[codec] = {**store_bytes(store), "tau_hat": tau_hat(run_dir), "tau": dec["tau"],
                      "identical": dec["identical_prompts"],
                      "seconds": {k: round(v, 1) for k, v in seconds.items()}}
        print(json.dumps({codec: out[codec]}), flush=True)
    base = out.get("blosc", out[demo_codec])  # ratios against the lossless arm where it ran
    for name, a in out.items():
        a["x_blosc_bytes"] = a["bytes_per_token"] / base["bytes_per_token"]
        a["x_blosc_tau"] = a["tau"] / base["tau"]
        a["x_blosc_tau_hat"] = a["tau_hat"] / base["tau_hat"]
    return {"demo": str(src), "budget": cfg.budget, "device": cfg.device, "decoded_prompts": len(prompts.read_text(
        ).splitlines()), "arms": out}


def print_arms(result: dict) -> None:
    n = result["decoded_prompts"]
    for name, a in result["arms"].items():
        print(f"{name:7s} {a['bytes_per_token']:10,.0f} B/token ({a['x_blosc_bytes']:.3f}x blosc"
              + f", {a['x_raw']:.3f}x raw bf16), held-out tau_hat {a['tau_hat']:.3f} "
              f"({a['x_blosc_tau_hat']:.3f}x), measured tau {a['tau']:.3f} ({a['x_blosc_tau']:.3f}x) over {n} prompts, "
              f"{a['identical']}/{n} identical to greedy", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="bytes and error: the target folder (default: the demo's SmolLM2)")
    p.add_argument("--store", type=Path,
                   help="bytes and error: read the features of this lossless (blosc or none) store, not a forward")
    p.add_argument("--codecs", default=None,
                   help="default: blosc,fp8,uq8,uq6,uq4,bf16m3,bf16m2,bf16m1 (bytes); blosc,fp8,uq4 (--demo)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of real features measured (bytes and error)")
    p.add_argument("--smoke", action="store_true", help="CPU, 1,024 tokens: bytes a token and error only")
    p.add_argument("--demo", type=Path, help="A/B: a finished `dflash demo` folder (its data, store, run, decoding)")
    p.add_argument("--work", type=Path, default=Path("codec-ab"), help="A/B: folder of the arms (resumable)")
    p.add_argument("--json", type=Path, help="A/B: also write the result here")
    args = p.parse_args(argv)
    if args.demo is not None:
        result = arms(args.demo, args.work, (args.codecs or "blosc,fp8,uq4").split(","))
        print_arms(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return
    codecs = (args.codecs or "blosc,fp8,uq8,uq6,uq4,bf16m3,bf16m2,bf16m1").split(",")
    if args.store is not None:  # what a store holds: the features extraction wrote (a demo's: its answers)
        bits = stored_features(args.store, args.tokens)
        print(f"{bits.shape[0]} tokens of the lossless store {args.store}")
    else:
        from dflash.demo.assets import prompts_path, smollm2_folder  # the demo's prompts: real, varied text

        with open(prompts_path(), encoding="utf-8") as f:
            texts = [json.dumps(json.loads(line)) for line in f if line.strip()]
        import torch

        device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        model = args.model or str(smollm2_folder())
        bits, ids = features(model, texts, 1024 if args.smoke else args.tokens, device)
        print(f"{bits.shape[0]} tokens of layers {ids} of {model}")
    for r in measure(bits, codecs):
        dec = f"  decode {r['decode_mb_s']:,.0f} MB/s" if r["decode_mb_s"] else ""
        print(f"{r['codec']:8s} {r['bytes_per_token']:10,.0f} B/token  {r['x_raw']:.3f}x raw bf16  rel. error mean "
              f"{r['rel_error_mean']:.4f} max {r['rel_error_max']:.4f} bulk {r['bulk_error_mean']:.4f}  encode "
              f"{r['encode_mb_s']:,.0f} MB/s{dec}", flush=True)


if __name__ == "__main__":
    main()
