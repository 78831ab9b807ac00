"""Where a speculative block's time goes on the static decoder: each part captured as its own CUDA graph and replayed.

    source bench/device_env.sh && python3 bench/decode.py [--smoke]

A random SmolLM2-135M-shaped Llama target (fp32, as decoding verifies) and a 2-layer block-8 drafter of the demo's
gpu budget (dflash2 and dflash), a context of --context tokens. Times, per replay (CUDA events over --reps replays):
the greedy step (one target token), the target's block verification (B tokens + lm_head + argmax), the drafter's
block (B-1 drafts), its context update (B new rows), and the whole block graph `StaticDecoder` replays; then the
ratio block / step, which speculative decoding must beat with its tau to be faster in wall clock. --tree-budgets
16,64 adds the whole tree graph `StaticTreeDecoder` replays per budget and its ratio to the path's block, which the
tree's measured tau must beat (over the path's) for trees to beat the path in wall clock.
--dtypes runs it in several numerics (fp32; tf32: fp32 with TF32 matmuls; bf16: weights, caches and activations in
bf16); --kernels adds, per part, the device time of its kernels run eagerly (count, sum, the top kernels), which
tells launch-bound parts (sum far below the replay) from slow kernels.
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
SMOKE = {**SMOLLM2, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
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


def _kernels(fn, device: torch.device, top: int = 8) -> dict:
    """Return the kernels of one eager call of fn: their count, summed device ms and the top ones by time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kinds: dict[str, list[float]] = {}
    for e in prof.events():
        if device.type == "cuda" and e.device_type.name != "CUDA":
            continue
        if device.type != "cuda" and (e.cpu_children or not e.name.startswith("aten::")):
            continue
        us = e.device_time if device.type == "cuda" else e.cpu_time
        kinds.setdefault(e.name[:70], []).append(us)
    total = sum(sum(v) for v in kinds.values())
    ranked = sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"count": sum(len(v) for v in kinds.values()), "sum_ms": round(total / 1e3, 3),
            "top": [{"kernel": k, "n": len(v), "ms": round(sum(v) / 1e3, 3)} for k, v in ranked]}


def alternatives(device: torch.device, shape: dict, reps: int, context: int) -> dict:
    """Return ms per call of ways to run the verify's fp32 matmuls (8 rows) and its attention, and whether each
    gives the rows bit for bit what a one-row call gives (the greedy step's numerics)."""
    F = torch.nn.functional
    H, I, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(0)
    out = {"matmul": [], "attention": []}
    for name, (k, n) in {"q/o": (H, H), "k/v": (H, kv), "gate/up": (H, I), "down": (I, H), "lm_head": (H, V)}.items():
        w = torch.randn(n, k, device=device, generator=g) / k ** 0.5
        x = torch.randn(8, k, device=device, generator=g)
        res = torch.empty(8, n, device=device)
        wt = w.t()
        ways = {
            "F.linear (today)": lambda: res.copy_(F.linear(x, w)),
            "bmm, stride-0 weight": lambda: res.copy_(torch.bmm(x[:, None], wt.expand(8, k, n))[:, 0]),
            "mm(W, x^T)^T": lambda: res.copy_(torch.mm(w, x.t()).t()),
            "8 one-row F.linear": lambda: [res[i : i + 1].copy_(F.linear(x[i : i + 1], w)) for i in range(8)],
        }
        one = torch.cat([F.linear(x[i : i + 1], w) for i in range(8)])
        row = {"shape": f"{name} {k}->{n}"}
        for way, fn in ways.items():
            fn()
            same = bool(torch.equal(res, one))
            row[way] = {"ms": round(_time(_graph(fn, device), reps, device), 4), "rows_equal_one_row": same}
        out["matmul"].append(row)
    heads, kvh, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    rep = heads // kvh
    for t in (1, 8):
        q = torch.randn(1, kvh, rep * t, d, device=device, generator=g)
        kk = torch.randn(1, kvh, context, d, device=device, generator=g)
        vv = torch.randn(1, kvh, context, d, device=device, generator=g)
        mask = torch.ones(1, 1, rep * t, context, dtype=torch.bool, device=device)
        mask[..., -t:] = torch.ones(t, t, dtype=torch.bool, device=device).tril().repeat(rep, 1)
        res = torch.empty_like(q)
        bias = torch.zeros(1, 1, rep * t, context, device=device).masked_fill(~mask, float("-inf"))
        ways = {
            "sdpa (today)": lambda: res.copy_(F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)),
            "matmul + softmax": lambda: res.copy_(torch.softmax(q @ kk.transpose(-1, -2) * d ** -0.5 + bias, -1)
                                                   @ vv),
        }
        row = {"shape": f"{rep * t} query rows x {context} keys"}
        for way, fn in ways.items():
            row[way] = {"ms": round(_time(_graph(fn, device), reps, device), 4)}
        out["attention"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dtypes", default="fp32", help="comma-separated: fp32, tf32, bf16")
    ap.add_argument("--kernels", action="store_true", help="also profile each part's kernels (eager)")
    ap.add_argument("--tree-budgets", default="", help="comma-separated node budgets: also time the whole tree block "
                    "StaticTreeDecoder replays (draft, device tree, verify, walk, cache moves) for each")
    ap.add_argument("--compile", action="store_true",
                    help="also time the target's step and verify compiled by torch.compile (fixed shapes) inside the "
                         "graph, in the first of --dtypes: what fusing its elementwise kernels would give")
    ap.add_argument("--alternatives", action="store_true",
                    help="only time ways to run the verify's fp32 matmuls and attention (bit-equality to one row)")
    args = ap.parse_args()
    if args.alternatives:
        dev = torch.device("cpu" if args.smoke else "cuda")
        alt = alternatives(dev, SMOKE if args.smoke else SMOLLM2, 3 if args.smoke else args.reps, args.context)
        for kind, rows in alt.items():
            for r in rows:
                print(kind, json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(alt, f, indent=2)
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter
    from dflash.decode.static import StaticDecoder
    from dflash.decode.static_tree import StaticTreeDecoder
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
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    budgets = [int(n) for n in args.tree_budgets.split(",") if n.strip()]
    unknown = set(names) - {"fp32", "tf32", "bf16"}
    if unknown:
        ap.error(f"--dtypes {sorted(unknown)}: choose from fp32, tf32, bf16")
    for numerics, kind in [(n, k) for n in names for k in ("dflash2", "dflash")]:
        dtype = torch.bfloat16 if numerics == "bf16" else torch.float32
        torch.backends.cuda.matmul.allow_tf32 = numerics == "tf32"
        torch.backends.cudnn.allow_tf32 = numerics == "tf32"
        target.to(dtype)
        extra = dict(drafter="dflash2") if kind == "dflash2" else {}
        cfg = DrafterConfig.from_target(dict(shape, model_type="llama"), target_layer_ids=layer_ids, mask_token_id=0,
                                        draft_layers=2, block_size=8, **extra)
        drafter = DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()
        with torch.inference_mode():
            dec = StaticDecoder(target, drafter, max_len=args.context + 160, cuda_graphs=False)
            prompt = torch.randint(0, shape["vocab_size"], (args.context,)).tolist()
            dec._prefill(prompt, [], features=True)
            width = dec._width(args.context + dec.B)
            block = torch.zeros(dec.B, dtype=torch.long, device=device)
            feats = torch.zeros(dec.B, len(layer_ids) * shape["hidden_size"], device=device, dtype=dtype)
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
            if args.compile and kind == "dflash2" and numerics == names[0]:
                fwd = torch.compile(dec.target.forward, dynamic=False)
                c0 = time.perf_counter()

                def verify_c():
                    h, f = fwd(block, pos, width, features=True)
                    feats.copy_(f)
                    block.copy_(dec.lm_head(h).argmax(-1))

                def step_c():
                    return fwd(block[:1], pos, width)

                for fn in (verify_c, step_c):
                    fn()
                compile_s = time.perf_counter() - c0
                parts["greedy step, compiled"] = step_c
                parts["target verify, compiled"] = verify_c
            row = {"numerics": numerics, "drafter": kind}
            if "greedy step, compiled" in parts:
                row["compile s"] = round(compile_s, 1)
            for name, fn in parts.items():
                row[name] = round(_time(_graph(fn, device), reps, device), 3)
                if args.kernels and (kind == "dflash2" or name.startswith("drafter")):
                    row.setdefault("kernels", {})[name] = _kernels(fn, device)

            def whole():
                dec._block(width)
                dec.pos.copy_(pos)  # stay at the same context length: every replay does the same work
                dec.n.zero_()

            row["whole block"] = round(_time(_graph(whole, device), reps, device), 3)
            row["block / step"] = round(row["whole block"] / row["greedy step (1 target token)"], 2)
            for budget in budgets:
                tree = StaticTreeDecoder(target, drafter, budget=budget, max_len=args.context + 160, cuda_graphs=False)
                tree._prefill(prompt, [], features=True)
                tree_width = tree._width(args.context + budget + 1)

                def whole_tree():
                    tree._tree(tree_width)
                    tree.pos.copy_(pos)
                    tree.n.zero_()

                row[f"whole tree N={budget}"] = round(_time(_graph(whole_tree, device), reps, device), 3)
                row[f"tree N={budget} / block"] = round(row[f"whole tree N={budget}"] / row["whole block"], 2)
        results["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        for name, k in row.get("kernels", {}).items():
            top = "; ".join(f"{t['kernel']} x{t['n']} {t['ms']:.3f} ms" for t in k["top"][:4])
            print(f"  kernels of {name}: {k['count']} launched, {k['sum_ms']:.3f} ms of device time; {top}", flush=True)
    print("RESULT " + json.dumps({**results, "rows": [{k: v for k, v in r.items() if k != "kernels"}
                                                      for r in results["rows"]]}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
