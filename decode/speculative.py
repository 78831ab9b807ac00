"""DFlash speculative decoding: draft a block from the target's features, verify it in one target forward, repeat.

The loop, per prompt: a prefill forward gives the first token and the features of the prompt; then, block after
block, the drafter proposes B-1 tokens after the anchor (the newest token, whose features the target has not made
yet), the target runs once over [anchor, drafts] with its KV cache, the longest prefix of drafts equal to the
target's own choices is accepted together with the target's next token, the cache is cut back to what was accepted,
and the features of the accepted positions join the context. At temperature 0 the output is, by construction, the
target's greedy decoding; `greedy_decode` is the baseline it is compared with, token for token and in forwards.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import InputError
from .decoded import Decoded, cut_at_stop
from ..drafter.model import DFlashDrafter, draft_logits, draft_tokens

__all__ = [
    "Decoded",
    "Proposer",
    "drafter_proposer",
    "load_target",
    "greedy_decode",
    "speculative_decode",
    "block_anchors",
    "decoding_walk",
    "TeacherForced",
    "teacher_forced",
    "compare_one",
    "summarize",
    "compare_on_prompts",
    "static_decoder",
]

log = logging.getLogger(__name__)

# propose(context_features [S, n*H], anchor_id, anchor_pos) -> draft token ids [B-1] for positions anchor_pos+1...
Proposer = Callable[[torch.Tensor, int, int], torch.Tensor]


def load_target(path: str | os.PathLike, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Any:
    """Return the target causal LM of a Hugging Face folder, in eval mode on device (fp32 by default: greedy ties)."""
    from ..target.load import load_target as load

    return load(path, device=device, dtype=dtype, option="--target")


def drafter_proposer(drafter: DFlashDrafter, target: Any, *, logits: bool = False) -> Proposer:
    """Return the Proposer that drafts greedily with a DFlash drafter and the target's own embedding and lm_head
    (argmax per slot; a DFlash 2 drafter's candidate selector path, see `draft_tokens`); with logits=True it
    returns each slot's logits [B-1, V] instead (`draft_logits`: what a tree is built from).

    The context's projection (fc + hidden_norm, one row per token) is kept between calls and only new rows are
    projected: a decoding's context only grows, so re-projecting all of it for every block is waste (measured on
    the 2-core CPU, SmolLM2 shape, 250-token context: 30.7 -> 29.2 ms a block; the 49K-row lm_head dominates). The cache is reused only while the context still ends its cached part with the same
    features row (a new prompt, or any other context, starts it again).
    """
    dtype = drafter.fc.weight.dtype
    embed = target.get_input_embeddings().weight.detach().to(dtype)  # once, not per block
    head = target.get_output_embeddings().weight.detach().to(dtype)
    cache: dict[str, torch.Tensor] = {}

    def project(features: torch.Tensor, upto: int) -> torch.Tensor:
        done = cache.get("projected")
        n = 0 if done is None else done.shape[0]
        if n > upto or (n and not torch.equal(features[n - 1], cache["last"])):
            done, n = None, 0
        if done is None or n < upto:
            new = drafter.project_context(features[n:upto].to(dtype))
            done = new if done is None else torch.cat([done, new])
            cache.update(projected=done, last=features[upto - 1].clone() if upto else features[:0])
        return done[:upto]

    @torch.inference_mode()
    def propose(features: torch.Tensor, anchor_id: int, anchor_pos: int) -> torch.Tensor:
        ctx = project(features, min(features.shape[0], int(anchor_pos)))
        return (draft_logits if logits else draft_tokens)(drafter, ctx, anchor_id, embed, head, anchor_pos,
                                                          projected=True)

    return propose


def _features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Return [T, n*H]: the outputs of decoder layers layer_ids (hidden_states[i + 1]) of batch row 0, layer-major."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


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
    from ..target.cache import Rollback, decoding_cache

    if block_size < 2:
        raise InputError(f"block size must be >= 2, got {block_size}")
    if not prompt_ids:
        raise InputError("speculative decoding needs a prompt of at least one token, got none")
    device = target.device
    stops = set(int(s) for s in stop_ids)
    cache = decoding_cache(target)
    rollback = Rollback(cache)
    prompt = torch.tensor([list(prompt_ids)], device=device)
    kv = _with_cache(target, cache)
    out = target(input_ids=prompt, **kv, use_cache=True, logits_to_keep=1, output_hidden_states=True)
    context = _features(out.hidden_states, layer_ids)  # features of positions 0..S-1
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
        # recurrent layer cannot forget: its state goes back to before the block and the kept tokens run again.
        if rollback.cut(block.shape[1], n_ok + 1):
            out = target(input_ids=block[:, : n_ok + 1], **kv, use_cache=True, output_hidden_states=True)
            forwards += 1
        context = torch.cat([context, _features(out.hidden_states, layer_ids)[: n_ok + 1]])
    return Decoded(tokens=tokens, forwards=forwards, accepted=accepted)


def block_anchors(decoded: Decoded) -> list[int]:
    """Return the index into decoded.tokens of each verified block's anchor: 0, then after each block's gain."""
    out, at = [], 0
    for gained in decoded.accepted:
        out.append(at)
        at += gained
    return out


def decoding_walk(streaks: Sequence[int], n: int) -> tuple[list[int], list[int]]:
    """Return (anchors, gains) of the blocks a greedy speculative decoding of an n-token answer takes, given the
    teacher-forced streak at every anchor 0..n-2: each block gains min(1 + streak, tokens left) and the next block
    starts where it ends. Decoding visits hard stretches block by block and crosses easy ones in a few long
    blocks, so the mean of its gains is below the mean over every anchor (tau_hat) even when both agree per anchor.
    """
    anchors, gains, i = [], [], 0
    while i < n - 1:
        g = min(1 + int(streaks[i]), n - 1 - i)
        anchors.append(i)
        gains.append(g)
        i += g
    return anchors, gains


@dataclass
class TeacherForced:
    """Teacher-forced drafting over one decoded answer, at chosen anchors (indices into the answer's tokens).

    streaks[j]: leading drafts equal to the answer's own next tokens at anchor j (slots past the answer's end do
    not count, as in training); gains[j] = min(1 + streaks[j], tokens left after the anchor): what a verification
    at that anchor adds to the answer, since decoding gains no target token beyond the answer's end.
    """

    anchors: list[int]
    streaks: list[int]
    gains: list[int]

    @property
    def tau_hat(self) -> float:
        """Return 1 + mean streak: what `dflash eval` reports, over these anchors (0 if none)."""
        return 1.0 + sum(self.streaks) / len(self.streaks) if self.streaks else 0.0

    @property
    def tau(self) -> float:
        """Return the mean gain: what speculative decoding measures when its blocks start at these anchors."""
        return sum(self.gains) / len(self.gains) if self.gains else 0.0


@torch.inference_mode()
def teacher_forced(target: Any, propose: Proposer, prompt_ids: Sequence[int], tokens: Sequence[int], *,
                   block_size: int, layer_ids: Sequence[int], anchors: Sequence[int] | None = None) -> TeacherForced:
    """Return teacher-forced drafting over the answer `tokens` of a prompt, as `dflash eval` scores a stored one.

    The drafter sees what training gives it: the features of one target forward over prompt + answer without a
    cache (what `extract` stores), and at anchor i (position len(prompt) + i, token tokens[i]) the features of
    the positions before it. anchors: indices into tokens; default every i with a next token (training's
    candidates). With `block_anchors` of a speculative decoding of the same answer, gains are what that decoding
    accepted, block for block, unless the decoding loop hands the drafter something else.
    """
    S, n = len(prompt_ids), len(tokens)
    picked = list(range(n - 1)) if anchors is None else [int(i) for i in anchors]
    if any(not 0 <= i < n for i in picked):
        raise InputError(f"anchors must index the answer's {n} tokens, got {picked}")
    ids = torch.tensor([list(prompt_ids) + list(tokens)], device=target.device)
    out = target(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
    features = _features(out.hidden_states, layer_ids)
    streaks, gains = [], []
    for i in picked:
        drafts = propose(features[: S + i], int(tokens[i]), S + i)[: block_size - 1].tolist()
        truth = list(tokens[i + 1: i + block_size])
        streak = next((k for k, (d, t) in enumerate(zip(drafts, truth)) if d != t), min(len(drafts), len(truth)))
        streaks.append(streak)
        gains.append(min(1 + streak, n - 1 - i))
    return TeacherForced(anchors=picked, streaks=streaks, gains=gains)


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


def compare_on_prompts(target: Any, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]], *,
                       max_new_tokens: int, stop_ids: Sequence[int] = (), parity: bool = False,
                       on_prompt: Callable[[int, dict[str, Any]], None] | None = None,
                       engine: str = "auto", trees: dict[int, Any] | None = None) -> dict[str, Any]:
    """Return `summarize` of greedy speculative decoding against plain greedy decoding over the prompts (and of
    tree decoding: trees as compare_one takes them)."""
    propose = drafter_proposer(drafter, target)
    decoder = static_decoder(target, drafter, prompts, max_new_tokens=max_new_tokens, engine=engine)
    rows = []
    for i, ids in enumerate(prompts):
        rows.append(compare_one(target, propose, ids, block_size=drafter.config.block_size,
                                layer_ids=drafter.config.target_layer_ids, max_new_tokens=max_new_tokens,
                                stop_ids=stop_ids, parity=parity, decoder=decoder, trees=trees))
        if on_prompt is not None:
            on_prompt(i, rows[-1])
    return summarize(rows)
