"""DFlash speculative decoding: draft a block from the target's features, verify it in one target forward, repeat.

The loop, per prompt: a prefill forward gives the first token and the features of the prompt; then, block after
block, the drafter proposes B-1 tokens after the anchor (the newest token, whose features the target has not made
yet), the target runs once over [anchor, drafts] with its KV cache, the longest prefix of drafts equal to the
target's own choices is accepted together with the target's next token, the cache is cut back to what was accepted,
and the features of the accepted positions join the context. At temperature 0 the output is, by construction, the
target's greedy decoding; `greedy_decode` is the baseline it is compared with, token for token and in forwards
(`compare_one` rows, `summarize` totals; the drafter's side, teacher-forced parity included, is decode/drafting.py).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import torch

from ..errors import InputError
from .decoded import Decoded, cut_at_stop
from .drafting import Proposer, block_anchors, layer_features, teacher_forced
from ..drafter.model import DFlashDrafter

__all__ = [
    "Decoded",
    "load_target",
    "greedy_decode",
    "speculative_decode",
    "compare_one",
    "summarize",
    "static_decoder",
]

log = logging.getLogger(__name__)


def load_target(path: str | os.PathLike, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Any:
    """Return the target causal LM of a Hugging Face folder, in eval mode on device (fp32 by default: greedy ties)."""
    from ..targets.load import load_target as load

    return load(path, device=device, dtype=dtype, option="--target")


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Return the target's token for each row of logits [N, V]: argmax at temperature 0, else a sample."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _with_cache(target: Any, cache: Any) -> dict[str, Any]:
    """Return the keyword that hands `cache` to the target's forward: `cache` in recent transformers releases,
    `past_key_values` before. An unknown keyword would vanish into **kwargs and every forward would see no context."""
    import inspect

    params = inspect.signature(target.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


@torch.inference_mode()
def greedy_decode(target: Any, prompt_ids: Sequence[int], *, max_new_tokens: int,
                  stop_ids: Sequence[int] = (), temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> Decoded:
    """Return the target's plain autoregressive decoding (one forward per token, KV cache), the baseline."""
    from transformers import DynamicCache

    device = target.device
    cache = DynamicCache(config=target.config)  # a layer of each kind the target has (sliding, linear attention)
    stops = set(int(s) for s in stop_ids)
    ids = torch.tensor([list(prompt_ids)], device=device)
    out: list[int] = []
    forwards = 0
    kv = _with_cache(target, cache)
    while True:
        logits = target(input_ids=ids, **kv, use_cache=True, logits_to_keep=1).logits
        forwards += 1
        tok = int(_choose(logits[0, -1:], temperature, generator)[0])
        out.append(tok)
        out, done = cut_at_stop(out, max_new_tokens, stops)
        if done:
            return Decoded(tokens=out, forwards=forwards)
        ids = torch.tensor([[tok]], device=device)


@torch.inference_mode()
def speculative_decode(target: Any, propose: Proposer, prompt_ids: Sequence[int], *, block_size: int,
                       layer_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                       temperature: float = 0.0, generator: torch.Generator | None = None) -> Decoded:
    """Return the DFlash speculative decoding of one prompt: tokens, tokens gained per block, target forwards.

    `propose` drafts B-1 tokens from the context features; every draft is checked against the target's own choice
    at its position (argmax, or a sample at temperature > 0, which keeps the output distributed as the target's).
    """
    from ..targets.cache import Rollback, decoding_cache

    if block_size < 2:
        raise InputError(f"block size must be >= 2, got {block_size}")
    if not prompt_ids:
        raise InputError("speculative decoding needs a prompt of at least one token, got none")
    device = target.device
    stops = set(int(s) for s in stop_ids)
    cache = decoding_cache(target, block_size)
    rollback = Rollback(cache)
    prompt = torch.tensor([list(prompt_ids)], device=device)
    kv = _with_cache(target, cache)
    out = target(input_ids=prompt, **kv, use_cache=True, logits_to_keep=1, output_hidden_states=True)
    rollback.cut(prompt.shape[1], prompt.shape[1])  # drops what the layers recorded of the prompt
    context = layer_features(out.hidden_states, layer_ids)  # features of positions 0..S-1
    tokens = [int(_choose(out.logits[0, -1:], temperature, generator)[0])]
    accepted: list[int] = []
    forwards = 1
    tokens, done = cut_at_stop(tokens, max_new_tokens, stops)
    while not done:
        anchor_pos = context.shape[0]  # the newest token: known, but not yet run through the target
        drafts = propose(context, tokens[-1], anchor_pos)[: block_size - 1].to(device)
        block = torch.cat([torch.tensor([tokens[-1]], device=device), drafts]).long()[None]
        if rollback.recurrent:
            rollback.save()
        out = target(input_ids=block, **kv, use_cache=True, output_hidden_states=True)
        forwards += 1
        choice = _choose(out.logits[0], temperature, generator)  # choice[k]: the target's token at anchor_pos+k+1
        match = (block[0, 1:] == choice[:-1]).int()
        n_ok = int(match.cumprod(0).sum())
        new = block[0, 1:1 + n_ok].tolist() + [int(choice[n_ok])]
        kept, done = cut_at_stop(tokens + new, max_new_tokens, stops)
        accepted.append(len(kept) - len(tokens))
        tokens = kept
        # Keep the cache and the context for the anchor and the accepted drafts; the rejected tail is forgotten. A
        # recurrent layer crops to its state after the last kept token where transformers records one (5.25), else
        # its state goes back to before the block and the kept tokens run again.
        if rollback.cut(block.shape[1], n_ok + 1):
            out = target(input_ids=block[:, : n_ok + 1], **kv, use_cache=True, output_hidden_states=True)
            forwards += 1
        context = torch.cat([context, layer_features(out.hidden_states, layer_ids)[: n_ok + 1]])
    return Decoded(tokens=tokens, forwards=forwards, accepted=accepted)


def static_decoder(target: Any, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   engine: str = "auto") -> Any:
    """Return the StaticDecoder (decode/static.py: static caches, CUDA graphs on CUDA) sized for these prompts, or
    None for the dynamic loop: engine "dynamic", or "auto" when the target or drafter is not one it runs (logged).

    "auto" picks the static decoder on CUDA (measured on one H200, bench/RESULTS.md) and the dynamic loop on a CPU,
    where the static decoder's masked cache columns cost more than the graphs it cannot use save.
    """
    from .static import StaticDecoder, static_unsupported

    if engine not in ("auto", "static", "dynamic"):
        raise InputError(f"decoding engine {engine!r} is not one of auto, static, dynamic")
    on_cuda = target.lm_head.weight.device.type == "cuda"
    if engine == "dynamic" or (engine == "auto" and not on_cuda) or not prompts:
        return None
    why = static_unsupported(target, drafter)
    if why is not None:
        log.info("decode: dynamic cache loop (%s)", why)
        return None
    import time

    t0 = time.perf_counter()
    decoder = StaticDecoder(target, drafter, max_len=max(len(p) for p in prompts) + max_new_tokens)
    log.info("decode: static caches%s, %d columns, ready in %.1f s", ", cuda graphs" if decoder.graphs else "",
             decoder.max_len, time.perf_counter() - t0)
    return decoder


def compare_one(target: Any, propose: Proposer, prompt_ids: Sequence[int], *, block_size: int,
                layer_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                parity: bool = False, decoder: Any = None, trees: dict[int, Any] | None = None) -> dict[str, Any]:
    """Return one prompt's row: tau, blocks, tokens, forwards of greedy and speculative decoding, identical, seconds.

    decoder: a `static_decoder` runs both timed paths (greedy only, temperature 0); None, the dynamic loop.
    trees: {budget: tree.TreeDecoder}: each also decodes the prompt (timed), in row["trees"][str(budget)].

    parity=True adds teacher-forced drafting over the decoded answer (untimed): at the anchors the decoding used
    (streak_sum_same, gain_sum_same: 1 + streak and what a block there gains, to set beside the measured tau;
    blocks_differ: blocks whose teacher-forced gain is not the measured one) and at every anchor, as `dflash eval`
    samples them over a stored answer (streak_sum_every over anchors_every).
    """
    import time

    t0 = time.perf_counter()
    if decoder is not None:
        plain = decoder.greedy(prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    else:
        plain = greedy_decode(target, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    t1 = time.perf_counter()
    if decoder is not None:
        spec = decoder.speculative(prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    else:
        spec = speculative_decode(target, propose, prompt_ids, block_size=block_size, layer_ids=layer_ids,
                                  max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    t2 = time.perf_counter()
    grown = {}
    for budget, tree_decoder in (trees or {}).items():
        t3 = time.perf_counter()
        out = tree_decoder.decode(prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        grown[str(budget)] = dict(blocks=len(out.accepted), tokens=len(out.tokens), forwards=out.forwards,
                                  identical=out.tokens == plain.tokens, seconds=time.perf_counter() - t3)
    row = dict(tau=spec.tau, blocks=len(spec.accepted), tokens=len(spec.tokens), forwards_greedy=plain.forwards,
               forwards_speculative=spec.forwards, identical=plain.tokens == spec.tokens,
               seconds_greedy=t1 - t0, seconds_speculative=t2 - t1,
               engine="dynamic" if decoder is None else ("static+graphs" if decoder.graphs else "static"),
               **({"trees": grown} if grown else {}))
    if parity:
        kw = dict(block_size=block_size, layer_ids=layer_ids)
        same = teacher_forced(target, propose, prompt_ids, spec.tokens, anchors=block_anchors(spec), **kw)
        every = teacher_forced(target, propose, prompt_ids, spec.tokens, **kw)
        row.update(streak_sum_same=sum(same.streaks), gain_sum_same=sum(same.gains),
                   blocks_differ=sum(g != a for g, a in zip(same.gains, spec.accepted)),
                   streak_sum_every=sum(every.streaks), anchors_every=len(every.anchors))
    return row


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return the totals of compare_one rows: tau over all blocks, forwards, speed-ups, exactness, parity.

    Keys: prompts, tau (tokens gained per block over every block), tau_per_prompt, tokens, forwards_greedy,
    forwards_speculative, speedup_forwards (greedy forwards / speculative forwards), identical (every prompt),
    identical_prompts, seconds_greedy, seconds_speculative, speedup_wall_clock (greedy seconds / speculative
    seconds). Rows made with parity=True add tau_hat_same_anchors (teacher-forced 1 + mean streak at the anchors
    the decoding used), tau_forced_same_anchors (their gains: equals tau when decoding hands the drafter what
    training does), blocks_differ, and tau_hat_every_anchor (every anchor of the decoded answers, as eval samples).
    Rows with trees add trees: {budget: tau, forwards, speedup_forwards, seconds, speedup_wall_clock (against
    greedy), speedup_vs_path (speculative seconds / tree seconds), identical, identical_prompts}.
    """
    blocks = sum(r["blocks"] for r in rows)
    gained = sum(r["tokens"] - 1 for r in rows)  # every token but the prefill's came from a block
    fg, fs = sum(r["forwards_greedy"] for r in rows), sum(r["forwards_speculative"] for r in rows)
    sg, ss = sum(r["seconds_greedy"] for r in rows), sum(r["seconds_speculative"] for r in rows)
    out = {
        "prompts": len(rows),
        "tau": gained / blocks if blocks else 0.0,
        "tau_per_prompt": [round(r["tau"], 4) for r in rows],
        "tokens": sum(r["tokens"] for r in rows),
        "forwards_greedy": fg,
        "forwards_speculative": fs,
        "speedup_forwards": fg / fs if fs else 0.0,
        "identical": all(r["identical"] for r in rows),
        "identical_prompts": sum(bool(r["identical"]) for r in rows),
        "seconds_greedy": sg,
        "seconds_speculative": ss,
        "speedup_wall_clock": sg / ss if ss else 0.0,
        "tokens_per_s_greedy": sum(r["forwards_greedy"] for r in rows) / sg if sg else 0.0,
        "tokens_per_s_speculative": sum(r["tokens"] for r in rows) / ss if ss else 0.0,
        "engine": "+".join(sorted({str(r.get("engine", "dynamic")) for r in rows})),
    }
    if rows and all("trees" in r for r in rows):
        out["trees"] = {}
        for budget in [b for b in rows[0]["trees"] if all(b in r["trees"] for r in rows)]:
            t = [r["trees"][budget] for r in rows]
            n, f, sec = sum(x["blocks"] for x in t), sum(x["forwards"] for x in t), sum(x["seconds"] for x in t)
            out["trees"][budget] = dict(
                tau=sum(x["tokens"] - 1 for x in t) / n if n else 0.0, forwards=f,
                speedup_forwards=fg / f if f else 0.0, seconds=sec, speedup_wall_clock=sg / sec if sec else 0.0,
                speedup_vs_path=ss / sec if sec else 0.0, identical=all(x["identical"] for x in t),
                identical_prompts=sum(bool(x["identical"]) for x in t))
    if rows and all("streak_sum_same" in r for r in rows):
        every = sum(r["anchors_every"] for r in rows)
        out.update(
            tau_hat_same_anchors=1.0 + sum(r["streak_sum_same"] for r in rows) / blocks if blocks else 0.0,
            tau_forced_same_anchors=sum(r["gain_sum_same"] for r in rows) / blocks if blocks else 0.0,
            blocks_differ=sum(r["blocks_differ"] for r in rows),
            tau_hat_every_anchor=1.0 + sum(r["streak_sum_every"] for r in rows) / every if every else 0.0,
            anchors_every=every,
        )
    return out
