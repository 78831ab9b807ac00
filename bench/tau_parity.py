"""Why measured tau falls below tau_hat: each cause measured on the embedded SmolLM2-135M, on the CPU.

    PYTHONPATH=PP python bench/tau_parity.py --prompts 32 --tokens 64 --steps 250

Answers are written the way `generate` writes them on a GPU (bf16, left-padded batches, text re-tokenized through
the chat template, as `extract` stores them) and the way serving decodes (fp32, one prompt, greedy). A drafter is
trained on each set by the training objective (features of one fp32 target forward, rounded to bf16 as the store
keeps them) and scored on its own training prompts, where it is strong (held-out prompts this few give tau ~1):
  - stored answers, every anchor (what `dflash eval` computes), and the walk a decoding of them would take;
  - fp32 greedy decoded answers, every anchor; at the anchors speculative decoding used (1 + streak, and the
    gains with the end of the answer cut); measured tau of speculative decoding;
  - per position, how often the fp32 target's own next token differs from the stored answer's.
Prints one JSON line per drafter; nothing is written.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _prompts(tokenizer, n: int) -> list[list[dict]]:
    from dflash.demo.assets import prompts_path

    lines = [json.loads(ln) for ln in prompts_path().read_text(encoding="utf-8").splitlines() if ln.strip()][:n]
    return [rec["messages"] if "messages" in rec else [{"role": "user", "content": rec["prompt"]}] for rec in lines]


def _stored(tokenizer, messages, text: str, prompt_ids: list[int]) -> list[int]:
    """Return the answer's tokens as the store holds them: the text re-rendered and re-tokenized, through <|im_end|>."""
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": text}], tokenize=False)
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids, "the stored prefix is not the decoding prompt"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rest = ids[len(prompt_ids):]
    return rest[: rest.index(end) + 1] if end in rest else rest


def _batched(folder, tokenizer, chats, prompts, tokens: int, batch: int, stops, dtype) -> list[list[int]]:
    from dflash.targets.load import load_target

    model = load_target(folder, device="cpu", dtype=dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:  # transformers 5.17's GGUF conversion names none (as `generate` handles)
        tokenizer.pad_token = tokenizer.eos_token
    out = []
    for b in range(0, len(prompts), batch):
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chats[b:b + batch]]
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.inference_mode():
            seqs = model.generate(**enc, max_new_tokens=tokens, do_sample=False, eos_token_id=sorted(stops),
                                  pad_token_id=tokenizer.pad_token_id or sorted(stops)[0], temperature=None,
                                  top_k=None, top_p=None)
        for i, ids in enumerate(seqs[:, enc["input_ids"].shape[1]:].tolist()):
            stop = next((k for k, t in enumerate(ids) if t in stops), None)
            text = tokenizer.decode(ids if stop is None else ids[:stop], skip_special_tokens=True)
            out.append(_stored(tokenizer, chats[b + i], text, prompts[b + i]))
    return out


def _features(target, ids: list[int], layer_ids) -> torch.Tensor:
    with torch.inference_mode():
        hs = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], -1)


def _train(folder, target, prompts, answers, layer_ids, mask_id, steps: int, block: int):
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter
    from dflash.targets.head import load_target_head
    from dflash.train.objective import drafter_loss
    from dflash.train.packing import pack_batch

    cfg = DrafterConfig.from_target(folder, target_layer_ids=layer_ids, mask_token_id=mask_id, draft_layers=1,
                                    block_size=block)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    head = load_target_head(folder, dtype=torch.float32)
    seqs = []
    for p, a in zip(prompts, answers):
        mask = torch.zeros(len(p) + len(a), dtype=torch.bool)
        mask[len(p):] = True
        f = _features(target, p + a, layer_ids).bfloat16().float()  # the store keeps bf16 features
        seqs.append({"input_ids": torch.tensor(p + a), "loss_mask": mask, "features": f})
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    for step in range(steps):
        pick = [seqs[(step * 4 + j) % len(seqs)] for j in range(4)]
        batch = pack_batch(pick, block_size=block, mask_token_id=mask_id, max_anchors=16, seed=step)
        loss, _ = drafter_loss(drafter, batch, head.embed, head.lm_head)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
    return drafter.eval()


def _score(target, drafter, prompts, stored, layer_ids, tokens: int, stops) -> dict:
    from dflash.decode.drafting import block_anchors, decoding_walk, drafter_proposer, teacher_forced
    from dflash.decode.speculative import speculative_decode

    B = drafter.config.block_size
    propose = drafter_proposer(drafter, target)
    rounded = drafter_proposer(drafter, target)

    def bf16_features(f, a, p):
        return rounded(f.bfloat16().float(), a, p)

    kw = dict(block_size=B, layer_ids=layer_ids)
    sums = dict(store_streak=0, store_n=0, store_first_streak=0, store_first_n=0, every_streak=0, every_n=0,
                same_streak=0, same_gain=0, walk_gain=0, walk_blocks=0, blocks=0, gained=0, bf16_gain=0, differ=0, mismatch=0, positions=0,
                first_div=[])
    for p, a in zip(prompts, stored):
        st = teacher_forced(target, propose, p, a, **kw)
        sums["store_streak"] += sum(st.streaks); sums["store_n"] += len(st.streaks)
        _, walk = decoding_walk(st.streaks, len(a))  # the blocks a decoding of the stored answer would take
        sums["walk_gain"] += sum(walk); sums["walk_blocks"] += len(walk)
        first = [s for i, s in zip(st.anchors, st.streaks) if i < tokens - 1]
        sums["store_first_streak"] += sum(first); sums["store_first_n"] += len(first)
        with torch.inference_mode():  # the fp32 target's own next token after each stored prefix
            logits = target(input_ids=torch.tensor([p + a])).logits[0, len(p) - 1:-1]
        own = logits.argmax(-1).tolist()
        sums["mismatch"] += sum(o != t for o, t in zip(own, a)); sums["positions"] += len(a)
        spec = speculative_decode(target, propose, p, max_new_tokens=tokens, stop_ids=stops, **kw)
        d = spec.tokens
        sums["first_div"].append(next((i for i, (x, y) in enumerate(zip(d, a)) if x != y), min(len(d), len(a))))
        sums["blocks"] += len(spec.accepted); sums["gained"] += sum(spec.accepted)
        ev = teacher_forced(target, propose, p, d, **kw)
        sums["every_streak"] += sum(ev.streaks); sums["every_n"] += len(ev.streaks)
        sm = teacher_forced(target, propose, p, d, anchors=block_anchors(spec), **kw)
        sums["same_streak"] += sum(sm.streaks); sums["same_gain"] += sum(sm.gains)
        sums["differ"] += sum(g != x for g, x in zip(sm.gains, spec.accepted))
        bf = teacher_forced(target, bf16_features, p, d, anchors=block_anchors(spec), **kw)
        sums["bf16_gain"] += sum(bf.gains)
    b = sums["blocks"]
    return {
        "tau_hat_stored_every_anchor": 1 + sums["store_streak"] / sums["store_n"],
        "tau_hat_stored_first_tokens": 1 + sums["store_first_streak"] / sums["store_first_n"],
        "tau_walk_stored": sums["walk_gain"] / sums["walk_blocks"],
        "fp32_next_token_differs_from_stored": sums["mismatch"] / sums["positions"],
        "first_divergence_index": sums["first_div"],
        "tau_hat_decoded_every_anchor": 1 + sums["every_streak"] / sums["every_n"],
        "tau_hat_decoded_same_anchors": 1 + sums["same_streak"] / b,
        "tau_forced_same_anchors_end_cut": sums["same_gain"] / b,
        "tau_forced_same_anchors_bf16_features": sums["bf16_gain"] / b,
        "tau_measured": sums["gained"] / b,
        "blocks": b,
        "blocks_differ": sums["differ"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--gen-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="dtype of the batched answers: bf16 as `generate` on a GPU, fp32 as on the CPU")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from dflash.demo.assets import smollm2_folder
    from dflash.demo import SMOLLM2_MASK_TOKEN
    from dflash.decode.speculative import greedy_decode, load_target
    from dflash.facts import build_target_layer_ids

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    target = load_target(folder, dtype=torch.float32)
    layer_ids = build_target_layer_ids(target.config.num_hidden_layers)
    stops = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    chats = _prompts(tokenizer, args.prompts)
    prompts = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"]) for m in chats]
    t0 = time.perf_counter()
    bf16 = _batched(folder, tokenizer, chats, prompts, args.tokens, args.batch, stops, getattr(torch, args.gen_dtype))
    fp32 = []
    for m, p in zip(chats, prompts):
        g = greedy_decode(target, p, max_new_tokens=args.tokens, stop_ids=sorted(stops)).tokens
        text = tokenizer.decode([t for t in g if t not in stops], skip_special_tokens=True)
        fp32.append(_stored(tokenizer, m, text, p))
    print(json.dumps({"answers_seconds": round(time.perf_counter() - t0, 1),
                      "tokens_bf16": sum(map(len, bf16)), "tokens_fp32": sum(map(len, fp32))}), flush=True)
    for name, answers in ((f"{args.gen_dtype}_batched_answers", bf16), ("fp32_greedy_answers", fp32)):
        t0 = time.perf_counter()
        drafter = _train(folder, target, prompts, answers, layer_ids, SMOLLM2_MASK_TOKEN, args.steps, args.block)
        out = _score(target, drafter, prompts, answers, layer_ids, args.tokens, sorted(stops))
        out.update(trained_on=name, seconds=round(time.perf_counter() - t0, 1))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
