"""A fast decoder for `dflash generate`: static KV cache, continuous batching, CUDA graphs for the decode step.

transformers' `generate` pads a batch to its longest prompt, grows its cache by concatenation, keeps finished rows
decoding until the longest answer ends, and pays Python overhead for every kernel of every step. Here:
- the cache is allocated once, one row per slot ([slots, kv_heads, max_len, head_dim] per layer), and a slot's
  sequence always starts at column 0, so decoding needs no padding and a slot is reused by overwriting it;
- a slot whose answer ended is refilled with the next prompt (prompts sorted by length, prefilled together, right
  padded with a causal mask, so a real token never sees a pad), so the batch stays full;
- on CUDA the decode step of every cache-length bucket is captured once as a CUDA graph and replayed; the host
  reads the finished flags only every few steps, so the GPU runs ahead of Python.

It reuses the Hugging Face model's own modules (norms, projections, MLP, rotary embedding), so the arithmetic is
theirs; only attention and the cache are ours. Greedy tokens equal `generate`'s in fp32 (tests/test_generate_fast.py).
Sampling draws one uniform per (seed, request key, step) from a counter-based hash and inverts the CDF, so a
request's tokens do not depend on which slot or batch it ran in.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from ..targets.static_kv import fast_unsupported, model_rope

__all__ = ["Request", "Completion", "FastDecoder", "fast_unsupported"]

log = logging.getLogger(__name__)

_BUCKET = 64  # cache columns attention reads are rounded up to this (one CUDA graph per bucket)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Request:
    """A prompt to continue: its key (source row or draw index: also the sampling stream) and its token ids."""

    key: int
    ids: list[int]


@dataclass(frozen=True)
class Completion:
    """The new tokens of a request (the stop token excluded) and whether a stop token ended them."""

    key: int
    tokens: list[int]
    finished: bool


def _mix64(x: int) -> int:
    """Return splitmix64's finaliser of x (Python ints: the per-request key of the sampling stream)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & _MASK64


def _to_i64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _uniform(torch: Any, key: Any, step: Any) -> Any:
    """Return one float32 uniform in [0, 1) per row from (int64 key, int64 step): a hash, not a stateful RNG."""
    # Signed int64 arithmetic wraps; logical right shifts are emulated by masking the sign-extended bits.
    x = key ^ (step * _to_i64(0x9E3779B97F4A7C15))
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * _to_i64(mult)
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return ((x >> 40) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


class FastDecoder:
    """Continuous-batching decoder over a Hugging Face Llama/Qwen model: `run(requests)` yields completions."""

    def __init__(self, model: Any, *, slots: int, max_new_tokens: int, stop_ids: Iterable[int],
                 temperature: float = 0.0, seed: int = 0, prefill_tokens: int | None = None,
                 cuda_graphs: bool | None = None, sync_every: int | None = None) -> None:
        import torch

        why = fast_unsupported(model.config)
        assert why is None, why
        self.torch = torch
        self.model = model
        self.inner = model.model
        self.rope = model_rope(model)
        cfg = model.config
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.slots = slots
        self.max_new = max_new_tokens
        self.stop_ids = sorted(set(stop_ids))
        self.temperature = temperature
        self.seed = seed
        self.kv_heads = cfg.num_key_value_heads
        self.heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        on_cuda = self.device.type == "cuda"
        self.graphs = on_cuda if cuda_graphs is None else cuda_graphs
        # Tokens per prefill forward: big enough to fill the device, small enough for the activations.
        self.prefill_tokens = prefill_tokens or (65536 if on_cuda else 4096)
        # How often the host looks at the finished flags: each look is a device sync.
        self.sync_every = sync_every or (8 if on_cuda else 1)

    # ----- the model, layer by layer, over our cache -----

    def _attend(self, layer: Any, x: Any, cos: Any, sin: Any, cache: tuple[Any, Any], *, slots: Any = None,
                pos: Any = None, mask: Any = None, width: int = 0) -> Any:
        """Return the attention block's output for x; prefill (slots given) or one decode step (pos given)."""
        F = self.torch.nn.functional
        attn = layer.self_attn
        n, t, _ = x.shape
        q = attn.q_proj(x).view(n, t, -1, self.head_dim)
        k = attn.k_proj(x).view(n, t, -1, self.head_dim)
        v = attn.v_proj(x).view(n, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        ck, cv = cache
        if slots is not None:  # prefill: right padded, so causal alone keeps real tokens off the pads
            ck[slots, :, :t] = k
            cv[slots, :, :t] = v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)
            out = out.transpose(1, 2).reshape(n, t, -1)
        else:  # decode: write this token's k/v at its position, attend to columns <= it
            rows = self.rows
            ck[rows, :, pos] = k[:, :, 0]
            cv[rows, :, pos] = v[:, :, 0]
            # The query heads of one kv head act as that head's query positions: GQA without copying the cache.
            rep = self.heads // self.kv_heads
            qg = q.reshape(n, self.kv_heads, rep, self.head_dim)
            out = F.scaled_dot_product_attention(qg, ck[:, :, :width], cv[:, :, :width], attn_mask=mask,
                                                 scale=attn.scaling)
            out = out.reshape(n, 1, -1)
        return attn.o_proj(out)

    def _forward(self, ids: Any, positions: Any, **attend: Any) -> Any:
        """Return the final-norm hidden states of ids [n, t] at positions [n, t]."""
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, positions)
        for layer, cache in zip(self.inner.layers, self.cache):
            x = x + self._attend(layer, layer.input_layernorm(x), cos, sin, cache, **attend)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.inner.norm(x)

    def _pick(self, logits: Any, keys: Any, steps: Any) -> Any:
        """Return the next token of each row: argmax, or the inverse CDF at the row's hashed uniform."""
        torch = self.torch
        if self.temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        cdf = probs.cumsum(-1)
        u = _uniform(torch, keys, steps).unsqueeze(1) * cdf[:, -1:]
        return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=logits.shape[-1] - 1)

    # ----- state -----

    def _allocate(self, max_len: int) -> None:
        """Allocate the KV cache and the per-slot state (a cache that would not fit is a ConfigError)."""
        torch, dev, B = self.torch, self.device, self.slots
        self.max_len = max_len
        shape = (B, self.kv_heads, max_len, self.head_dim)
        need = 2 * len(self.inner.layers) * B * self.kv_heads * max_len * self.head_dim * self.dtype.itemsize
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else float("inf")
        if need > 0.8 * free:
            from ..errors import ConfigError

            raise ConfigError(
                f"--batch-size {B}: the KV cache of {B} slots x {max_len} tokens needs {need / 2**30:.1f} GiB, more "
                f"than 80% of the {free / 2**30:.1f} GiB free on {dev}; rerun with a smaller --batch-size"
            )
        self.cache = [(torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev))
                      for _ in self.inner.layers]
        log.info("fast decoder: %d slots x %d columns, KV cache %.2f GiB, cuda graphs %s", B, max_len, need / 2**30,
                 self.graphs)
        self.rows = torch.arange(B, device=dev)
        self.cols = torch.arange(max_len, device=dev)
        self.tok = torch.zeros(B, dtype=torch.long, device=dev)  # the token to feed next
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)  # its position
        self.n_gen = torch.zeros(B, dtype=torch.long, device=dev)  # tokens generated so far
        self.done = torch.ones(B, dtype=torch.bool, device=dev)  # no live request in the slot
        self.keys = torch.zeros(B, dtype=torch.long, device=dev)  # sampling stream of the slot's request
        self.out = torch.zeros(B, self.max_new, dtype=torch.long, device=dev)
        self.stops = torch.tensor(self.stop_ids, dtype=torch.long, device=dev)
        self.graph_of: dict[int, Any] = {}

    def _record(self, slots: Any, new: Any) -> None:
        """Store each slot's new token, count it and mark the slot done at a stop token or the length cap."""
        torch = self.torch
        live = ~self.done[slots]
        at = self.n_gen[slots].clamp(max=self.max_new - 1)
        old = self.out[slots, at]
        self.out[slots, at] = torch.where(live, new, old)
        n = self.n_gen[slots] + live.long()
        self.n_gen[slots] = n
        stop = (new.unsqueeze(1) == self.stops).any(1)
        self.done[slots] = self.done[slots] | stop | (n >= self.max_new)
        self.tok[slots] = torch.where(live, new, self.tok[slots])

    def _step(self, width: int) -> None:
        """One decode step of every slot, reading `width` cache columns; all in place (CUDA-graph safe)."""
        live = ~self.done
        mask = (self.cols[:width].unsqueeze(0) <= self.pos.unsqueeze(1)).view(self.slots, 1, 1, width)
        h = self._forward(self.tok.unsqueeze(1), self.pos.unsqueeze(1), pos=self.pos, mask=mask, width=width)
        new = self._pick(self.model.lm_head(h[:, 0]), self.keys, self.n_gen)
        self._record(self.rows, new)
        # a slot still live feeds its new token at the next position; a finished one stays (recomputed, unread)
        self.pos.add_((live & ~self.done).long())

    def _capture(self, width: int) -> Any:
        """Return the CUDA graph of one decode step at `width` (captured with every slot idle)."""
        torch = self.torch
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (cuBLAS workspaces, lazy inits)
                self._step(width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(width)
        return graph

    def _prefill(self, slots: list[int], reqs: list[Request]) -> None:
        """Write the prompts' k/v into their slots and record each one's first new token."""
        torch = self.torch
        t = max(len(r.ids) for r in reqs)
        ids = torch.zeros(len(reqs), t, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, : len(r.ids)] = torch.tensor(r.ids)
        ids = ids.to(self.device)
        idx = torch.tensor(slots, device=self.device)
        positions = torch.arange(t, device=self.device).unsqueeze(0).expand(len(reqs), t)
        h = self._forward(ids, positions, slots=idx)
        last = torch.tensor([len(r.ids) - 1 for r in reqs], device=self.device)
        logits = self.model.lm_head(h[torch.arange(len(reqs), device=self.device), last])
        keys = torch.tensor([_to_i64(_mix64(_mix64(self.seed) ^ r.key)) for r in reqs], device=self.device)
        self.keys[idx] = keys
        self.n_gen[idx] = 0
        self.done[idx] = False
        new = self._pick(logits, keys, torch.zeros_like(keys))
        self._record(idx, new)
        self.pos[idx] = last + 1

    # ----- the loop -----

    def run(self, requests: Iterable[Request], *, max_prompt: int) -> Iterator[list[Completion]]:
        """Yield lists of completions as slots finish; requests are taken lazily (an endless iterator is fine).

        max_prompt bounds every request's length (it sizes the cache); a caller that stops iterating stops the
        decoder (requests in flight are dropped).
        """
        torch = self.torch
        B = self.slots
        self._allocate(max_prompt + self.max_new)
        self.widths = sorted({min(self.max_len, w) for w in range(_BUCKET, self.max_len + _BUCKET, _BUCKET)})
        if self.graphs:
            with torch.inference_mode():
                for w in self.widths:
                    self.graph_of[w] = self._capture(w)
                torch.cuda.synchronize(self.device)
        source = iter(requests)
        exhausted = False
        free = list(range(B))
        held: dict[int, Request] = {}
        bound = [0] * B  # host-side upper bound of each live slot's position
        while True:
            if free and not exhausted and (len(free) >= max(1, B // 16) or not held):
                admitted: list[tuple[int, Request]] = []
                while free and not exhausted:
                    r = next(source, None)
                    if r is None:
                        exhausted = True
                        break
                    assert 0 < len(r.ids) <= max_prompt, (len(r.ids), max_prompt)
                    admitted.append((free.pop(), r))
                self._prefill_all(admitted)
                for s, r in admitted:
                    held[s] = r
                    bound[s] = len(r.ids)
            if not held:
                return
            top = max(bound[s] for s in held)
            for s in held:
                bound[s] = min(bound[s] + self.sync_every, self.max_len - 1)
            finished = self._advance(min(self.max_len, top + self.sync_every + 1), list(held))
            if finished:
                batch = []
                for s, toks in finished:
                    stopped = bool(toks) and toks[-1] in self.stop_ids
                    batch.append(Completion(held.pop(s).key, toks[:-1] if stopped else toks, stopped))
                    free.append(s)
                yield batch

    def _advance(self, need: int, held: list[int]) -> list[tuple[int, list[int]]]:
        """Run sync_every decode steps reading at least `need` columns; return (slot, tokens) of finished slots."""
        torch = self.torch
        width = next(w for w in self.widths if w >= need)
        with torch.inference_mode():
            for _ in range(self.sync_every):
                if self.graphs:
                    self.graph_of[width].replay()
                else:
                    self._step(width)
            done = self.done.tolist()
            finished = [s for s in held if done[s]]
            if not finished:
                return []
            idx = torch.tensor(finished, device=self.device)
            counts = self.n_gen[idx].tolist()
            rows = self.out[idx].tolist()
        return [(s, row[:n]) for s, n, row in zip(finished, counts, rows)]

    def _prefill_all(self, admitted: list[tuple[int, Request]]) -> None:
        """Prefill admitted (slot, request) pairs in length-sorted groups of at most prefill_tokens tokens."""
        admitted = sorted(admitted, key=lambda a: len(a[1].ids))
        groups: list[list[tuple[int, Request]]] = []
        for a in admitted:
            if groups and len(a[1].ids) * (len(groups[-1]) + 1) <= self.prefill_tokens:
                groups[-1].append(a)
            else:
                groups.append([a])
        with self.torch.inference_mode():
            for g in groups:
                self._prefill([s for s, _ in g], [r for _, r in g])
