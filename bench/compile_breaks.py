"""What transformers' output-capturing hooks cost a compiled decoder layer (issue 44): a Qwen3-MoE-shaped stack's
layers compiled as torch alone compiles them (`layer.compile(dynamic=True)`, the hooks on the attention and router
left in place: torch cannot trace the ContextVar they read, so each splits the layer), beside the same layers through
dflash's `targets.kernels.compile_layers` (those hooks removed first), over the same batches in one run: graph
breaks, graphs, the warm forward's seconds and their ratio, and the two forwards' largest difference.

    python bench/compile_breaks.py [--device cpu|cuda] [--hidden 256 --layers 4 --experts 16 --rows 4 --length 512]

The default shape is small enough for the 2-core CPU; on a GPU pass a real one (--hidden 2048 --layers 8
--experts 128 --top-k 8 --moe-width 768 --rows 3 --length 4096: the Qwen3-30B-A3B shape, 8 of its 48 layers).
"""
from __future__ import annotations

import argparse
import json
import time


def build(args: argparse.Namespace, device: str):  # noqa: ANN201 - a transformers model
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    head_dim = 32 if args.hidden < 1024 else 128
    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         moe_intermediate_size=args.moe_width or args.hidden // 2, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=2, head_dim=head_dim,
                         num_experts=args.experts, num_experts_per_tok=args.top_k,
                         max_position_embeddings=max(4096, args.length))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    ids = torch.randint(0, 1000, (args.rows, args.length), device=device)
    with torch.inference_mode():
        model(input_ids=ids, output_hidden_states=True)  # transformers installs its hooks on the first forward
    return model, ids


def timed(model, ids, device: str, repeat: int) -> tuple[float, object]:  # noqa: ANN001
    import torch
    from torch._dynamo.utils import counters

    def forward(x):  # noqa: ANN001, ANN202
        with torch.inference_mode():
            return model.model(input_ids=x, use_cache=False).last_hidden_state

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for rows, length in ((ids.shape[0], ids.shape[1] * 3 // 4), (ids.shape[0], ids.shape[1])):
        forward(ids[:rows, :length])  # compiles (dynamic shapes), then warm
    sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = forward(ids)
    sync()
    seconds = (time.perf_counter() - t0) / repeat
    return seconds, {"graph_breaks": sum(counters["graph_break"].values()),
                     "graphs": counters["stats"].get("unique_graphs", 0), "out": out.float()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-width", type=int, default=0, help="experts' width (default hidden / 2)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    import torch
    from torch._dynamo.utils import counters

    from dflash.targets import kernels

    results = {}
    for arm in ("torch_compile_hooks_kept", "dflash_compile_layers"):
        model, ids = build(args, args.device)
        torch._dynamo.reset()
        counters.clear()
        if arm == "dflash_compile_layers":
            kernels.compile_layers(model.model.layers)
        else:
            for layer in model.model.layers:
                layer.compile(dynamic=True)
        seconds, r = timed(model, ids, args.device, args.repeat)
        results[arm] = {"s_per_forward": round(seconds, 4), "tok_s": round(ids.numel() / seconds),
                        "graph_breaks": r["graph_breaks"], "graphs": r["graphs"], "out": r["out"]}
    a, b = results["torch_compile_hooks_kept"], results["dflash_compile_layers"]
    want, got = a.pop("out"), b.pop("out")
    diff = float((want - got).abs().max() / want.abs().max())
    print(json.dumps({"device": args.device, "shape": vars(args), **results, "max_diff_over_max": round(diff, 6),
                      "speedup": round(a["s_per_forward"] / b["s_per_forward"], 3)}, indent=1))


if __name__ == "__main__":
    main()
