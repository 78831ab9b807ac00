"""Where a speculative block's time goes on the static decoder: each part captured as its own CUDA graph and replayed.

    source bench/device_env.sh && python3 bench/decode.py [--smoke]

A random SmolLM2-135M-shaped Llama target (fp32, as decoding verifies) and a 2-layer block-8 drafter of the demo's
gpu budget (dflash2 and dflash), a context of --context tokens. Times, per replay (CUDA events over --reps replays):
the greedy step (one target token), the target's block verification (B tokens + lm_head + argmax), the drafter's
block (B-1 drafts), its context update (B new rows), and the whole block graph `StaticDecoder` replays; then the
ratio block / step, which speculative decoding must beat with its tau to be faster in wall clock.
--smoke runs the same code eagerly on the CPU with a small config, to check the script before GPU time.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
SMOKE = {**SMOLLM2, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _time(fn, reps: int, device: torch.device) -> float:
    """Return ms per call of fn (a graph replay or an eager call), after one warm-up."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize(device)
        return a.elapsed_time(b) / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e3 / reps


def _graph(fn, device: torch.device):
    """Return a callable replaying fn captured as a CUDA graph (fn itself on a CPU)."""
    if device.type != "cuda":
        return fn
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.drafter.model import DFlashDrafter, DrafterConfig
    from dflash.drafter.static_decode import StaticDecoder
    from dflash.facts import build_target_layer_ids

    device = torch.device("cpu" if args.smoke else "cuda")
    shape = SMOKE if args.smoke else SMOLLM2
    reps = 3 if args.smoke else args.reps
    torch.manual_seed(0)
    with torch.device(device):
        target = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    layer_ids = build_target_layer_ids(shape["num_hidden_layers"])
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "context": args.context, "rows": []}
    for kind in ("dflash2", "dflash"):
        extra = dict(drafter="dflash2") if kind == "dflash2" else {}
        cfg = DrafterConfig.from_target(dict(shape, model_type="llama"), target_layer_ids=layer_ids, mask_token_id=0,
                                        draft_layers=2, block_size=8, **extra)
        drafter = DFlashDrafter(cfg).to(device).eval()
        with torch.inference_mode():
            dec = StaticDecoder(target, drafter, max_len=args.context + 160, cuda_graphs=False)
            prompt = torch.randint(0, shape["vocab_size"], (args.context,)).tolist()
            dec._prefill(prompt, [], features=True)
            width = dec._width(args.context + dec.B)
            block = torch.zeros(dec.B, dtype=torch.long, device=device)
            feats = torch.zeros(dec.B, len(layer_ids) * shape["hidden_size"], device=device)
            pos = dec.pos.clone()

            def verify():
                h, f = dec.target.forward(block, pos, width, features=True)
                feats.copy_(f)
                block.copy_(dec.lm_head(h).argmax(-1))

            parts = {
                "greedy step (1 target token)": lambda: dec.target.forward(block[:1], pos, width),
                f"target verify ({dec.B} tokens)": verify,
                f"drafter ({dec.B - 1} drafts)": lambda: dec.drafter.draft(block[:1], pos, width),
                f"drafter context update ({dec.B} rows)": lambda: dec.drafter.add_context(feats, pos),
            }
            row = {"drafter": kind}
            for name, fn in parts.items():
                row[name] = round(_time(_graph(fn, device), reps, device), 3)

            def whole():
                dec._block(width)
                dec.pos.copy_(pos)  # stay at the same context length: every replay does the same work
                dec.n.zero_()

            row["whole block"] = round(_time(_graph(whole, device), reps, device), 3)
            row["block / step"] = round(row["whole block"] / row["greedy step (1 target token)"], 2)
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    print("RESULT " + json.dumps(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
