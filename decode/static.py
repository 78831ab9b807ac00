"""Speculative decoding and its greedy baseline on static KV caches, one CUDA graph replay per verified block.

The dynamic loop (speculative.py) grows transformers' DynamicCache, crops it after each verification, re-runs the
drafter's key/value projections over the whole context for every block and syncs with the host several times per
block. Here, per prompt:
- the target runs over `StaticTarget` (targets/static_kv.py) and the drafter over a cache of its context keys and values
  (one [kv_heads, max_len, head_dim] pair per drafter layer: a context row's key and value depend on that row and
  its position alone, so each is computed once, when the row is accepted);
- a block is one fixed sequence of kernels: draft B-1 tokens, verify [anchor, drafts] in one target forward, count
  the accepted drafts on the device, write the target's B choices into the output buffer and the B new feature rows
  into the drafter's cache at the block's positions (rows past the accepted ones are masked until overwritten), and
  move the anchor. On CUDA it is captured once per cache-width bucket and replayed; the host reads one pair of
  numbers per block (accepted count, stop token seen) to pick the next bucket and to stop;
- greedy decoding replays a captured one-token step and looks at the output every `sync_every` steps.
`StaticLoop` holds what this decoder shares with the tree decoder (static_tree.py): the caches, the device state, the
prefill, the capture and replay of one graph per kind of step and width, and the block loop with its one sync.
Greedy only (temperature 0): the sampled path stays in speculative.py. The output equals speculative.py's token for
token (tests/test_static_decode.py), and so do the acceptance counts, up to float rounding of the reordered sums.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch.nn import functional as F

from ..targets.static_kv import StaticTarget, fast_unsupported
from .decoded import Decoded, cut_at_stop
from ..drafter.model import DFlashDrafter, DFlash2Layer, apply_rope, block_embeddings, unary_logits

__all__ = ["StaticDrafter", "StaticLoop", "StaticDecoder", "static_unsupported", "BUCKET"]

log = logging.getLogger(__name__)

_MAX_STOPS = 64
BUCKET = 64  # cache columns a step reads are rounded up to this: one CUDA graph per bucket and path


def static_unsupported(target: Any, drafter: DFlashDrafter) -> str | None:
    """Return why the static decoder cannot run this target and drafter (None when it can)."""
    why = fast_unsupported(target.config)
    if why is None and drafter.fc.weight.device != target.lm_head.weight.device:
        why = "the drafter and the target are on different devices"
    return why


class StaticDrafter:
    """A drafter over a static cache of its context's keys and values (one sequence)."""

    def __init__(self, drafter: DFlashDrafter, target: Any, *, max_len: int) -> None:
        cfg = drafter.config
        self.model, self.cfg = drafter, cfg
        self.dtype = drafter.fc.weight.dtype
        self.device = drafter.fc.weight.device
        self.embed = target.get_input_embeddings().weight.detach().to(self.dtype)
        self.head = target.get_output_embeddings().weight.detach().to(self.dtype)
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        shape = (self.kv_heads, max_len, self.head_dim)
        self.cache = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in drafter.layers]
        self.cols = torch.arange(max_len, device=self.device)
        self.slots = torch.arange(cfg.block_size, device=self.device)
        self.mask_ids = torch.full((cfg.block_size - 1,), cfg.mask_token_id, dtype=torch.long, device=self.device)
        self.inv_freq = drafter._inv_freq.to(self.device)  # on the device once: no host copy inside a graph
        self.rope_scale = drafter._rope_scale

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return cos, sin [N, d] at positions, as DFlashDrafter._rope computes them."""
        freqs = positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    def add_context(self, features: torch.Tensor, pos0: torch.Tensor) -> None:
        """Write the keys and values of context rows features [t, n*H] at positions pos0.. into every layer's cache."""
        ctx = self.model.project_context(features)
        positions = pos0 + torch.arange(ctx.shape[0], device=self.device)
        cos, sin = self._rope(positions)
        for layer, (ck, cv) in zip(self.model.layers, self.cache):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(-1, self.kv_heads, self.head_dim)).transpose(0, 1)
            ck.index_copy_(1, positions, apply_rope(k, cos, sin))
            cv.index_copy_(1, positions, attn.v_proj(ctx).view(-1, self.kv_heads, self.head_dim).transpose(0, 1))

    def _visible(self, kind: str, pos: torch.Tensor, block_pos: torch.Tensor, width: int) -> torch.Tensor:
        """Return which keys [B, width + B] each block query sees: context columns < pos, and the whole block;
        a sliding layer also drops keys at distance >= its window (as the dynamic loop's masks do)."""
        B = block_pos.shape[0]
        ctx = (self.cols[:width] < pos).expand(B, width)
        seen = torch.cat([ctx, torch.ones(B, B, dtype=torch.bool, device=self.device)], dim=1)
        if kind == "sliding_attention":
            key_pos = torch.cat([self.cols[:width], block_pos])
            seen = seen & ((block_pos[:, None] - key_pos[None, :]).abs() < self.cfg.sliding_window)
        return seen

    def logits(self, anchor: torch.Tensor, pos: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (final-normed hidden states [B-1, H], unary logits [B-1, V]) of the block's draft slots after
        anchor [1] at position pos [1], attending to cache columns < pos (`draft_logits`' numbers, what a tree is
        built from)."""
        cfg = self.cfg
        B, d, rep = cfg.block_size, self.head_dim, self.heads // self.kv_heads
        x = block_embeddings(cfg, torch.cat([anchor.long(), self.mask_ids]), self.embed).to(self.dtype)
        block_pos = pos + self.slots
        cos, sin = self._rope(block_pos)
        masks = {kind: self._visible(kind, pos, block_pos, width).repeat(rep, 1)[None, None]
                 for kind in set(cfg.layer_types)}
        for layer, kind, (ck, cv) in zip(self.model.layers, cfg.layer_types, self.cache):
            attn = layer.self_attn
            h, taps = layer.input_layernorm(x), None
            if isinstance(layer, DFlash2Layer):
                h, taps = layer.attention_conv.prepare(h)
            q = apply_rope(attn.q_norm(attn.q_proj(h).view(B, self.heads, d)).transpose(0, 1), cos, sin)
            kx = apply_rope(attn.k_norm(attn.k_proj(h).view(B, self.kv_heads, d)).transpose(0, 1), cos, sin)
            vx = attn.v_proj(h).view(B, self.kv_heads, d).transpose(0, 1)
            k = torch.cat([ck[:, :width], kx], dim=1)[None]
            v = torch.cat([cv[:, :width], vx], dim=1)[None]
            out = F.scaled_dot_product_attention(q.reshape(1, self.kv_heads, rep * B, d), k, v, attn_mask=masks[kind])
            out = out.reshape(1, self.heads, B, d)
            x = layer.post(x, out) if taps is None else layer.post(x, out, taps)
        hidden = self.model.norm(x)[1:]
        raw = (hidden @ self.head.T).to(torch.promote_types(hidden.dtype, torch.float32))
        return hidden, unary_logits(cfg, raw)

    def draft(self, anchor: torch.Tensor, pos: torch.Tensor, width: int) -> torch.Tensor:
        """Return the greedy drafts [B-1] after anchor [1] at position pos [1], attending to cache columns < pos."""
        hidden, logits = self.logits(anchor, pos, width)
        if self.cfg.drafter == "dflash2":
            return self.model.candidate_selector.path(hidden, logits, anchor)
        return logits.argmax(-1)


class StaticLoop:
    """What the static decoders share: one target and drafter over static caches sized for max_len + room columns,
    the device state of a decoding (anchor token, its position, output buffer, stop ids), and one CUDA graph per
    kind of step (`_kinds`) and cache-width bucket, captured by `_capture_all` (on CUDA) and replayed by `_run`
    (run eagerly otherwise: the same code)."""

    def __init__(self, target: Any, drafter: DFlashDrafter, *, max_len: int, room: int,
                 cuda_graphs: bool | None) -> None:
        cfg = drafter.config
        self.B = cfg.block_size
        self.device = target.lm_head.weight.device
        self.graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.room = room
        self.max_len = max_len + room
        self.target = StaticTarget(target, max_len=self.max_len, feature_layers=cfg.target_layer_ids)
        self.lm_head = target.lm_head
        self.drafter = StaticDrafter(drafter, target, max_len=self.max_len)
        dev = self.device
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)  # the anchor / the token to feed next
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # its position
        self.n = torch.zeros(1, dtype=torch.long, device=dev)  # new tokens written to out after the first
        self.out = torch.zeros(self.max_len + self.B, dtype=torch.long, device=dev)
        self.stat = torch.zeros(2, dtype=torch.long, device=dev)  # (accepted drafts, a stop token among the new)
        self.stops = torch.full((_MAX_STOPS,), -1, dtype=torch.long, device=dev)  # a graph reads this very buffer
        self.slots = torch.arange(self.B, device=dev)
        self.widths = sorted({min(self.max_len, w) for w in range(BUCKET, self.max_len + BUCKET, BUCKET)})
        self.graph: dict[tuple[str, int], Any] = {}

    def _kinds(self) -> dict[str, Callable[[int], None]]:
        """Return {kind: step(width)}: the steps to capture, each all in place on device tensors."""
        raise NotImplementedError

    def _run(self, kind: str, width: int) -> None:
        if self.graphs:
            self.graph[kind, width].replay()
        else:
            self._kinds()[kind](width)

    def _capture_all(self) -> None:
        """Capture every kind at every width (state at zero; caches hold nothing a prompt needs yet)."""
        with torch.cuda.device(self.device), torch.inference_mode():
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(self.device)  # one side stream for every warm-up: one cuBLAS workspace
            for kind, fn in self._kinds().items():
                for w in self.widths:
                    self._zero()
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # warm-up outside the graph (cuBLAS workspaces, lazy inits)
                            self._zero()
                            fn(w)
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                    self._zero()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        fn(w)
                    self.graph[kind, w] = graph
            self._zero()
            torch.cuda.synchronize(self.device)
        log.info("%s: %d columns, %d cuda graphs", type(self).__name__, self.max_len, len(self.graph))

    def _zero(self) -> None:
        for t in (self.tok, self.pos, self.n, self.stat):
            t.zero_()

    def _width(self, need: int) -> int:
        return next(w for w in self.widths if w >= need)

    def _prefill(self, prompt_ids: Sequence[int], stop_ids: Sequence[int], features: bool) -> int:
        """Run the prompt (eager), leave the first new token in self.tok; return it."""
        S = len(prompt_ids)
        if not 0 < S <= self.max_len - self.room:
            raise ValueError(f"prompt of {S} tokens does not fit the static decoder's {self.max_len} columns")
        self._zero()
        stops = sorted({int(s) for s in stop_ids})
        if len(stops) > _MAX_STOPS:
            raise ValueError(f"{len(stops)} stop ids, more than the static decoder's {_MAX_STOPS}")
        self.stops.fill_(-1)
        self.stops[: len(stops)] = torch.tensor(stops, dtype=torch.long)
        ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=self.device)
        h, feats = self.target.forward(ids, self.pos, S, features=features)
        first = self.lm_head(h[-1:]).argmax(-1)
        if features:
            self.drafter.add_context(feats, self.pos)
        self.tok.copy_(first)
        self.pos.fill_(S)
        return int(first[0])

    def _start(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int],
               features: bool) -> tuple[int, set[int], int, list[int], bool]:
        """Return (prompt length, stop ids, first token, the answer so far, whether it is done) after the prefill."""
        S = len(prompt_ids)
        if S + max_new_tokens > self.max_len - self.room:
            raise ValueError(f"{S} + {max_new_tokens} tokens do not fit the static decoder's {self.max_len} columns")
        stops = {int(s) for s in stop_ids}
        first = self._prefill(prompt_ids, stop_ids, features=features)
        tokens, done = cut_at_stop([first], max_new_tokens, stops)
        return S, stops, first, tokens, done


    def _advance(self, new: torch.Tensor, n_ok: torch.Tensor) -> None:
        """End a block on the device: new [B] holds its n_ok + 1 new tokens first (the rest is overwritten later);
        write them to the output buffer, stat = (n_ok, a stop token among them), move the anchor past them."""
        self.out.index_copy_(0, self.n + self.slots, new)
        self.stat[0] = n_ok
        stop = (new[:, None] == self.stops[None, :]).any(1)  # not isin: it may sync
        self.stat[1] = (stop & (self.slots <= n_ok)).any().long()
        self.tok.copy_(new.gather(0, n_ok.view(1)))
        self.pos.add_(n_ok + 1)
        self.n.add_(n_ok + 1)

    def _blocks(self, kind: str, reach: int, prompt_ids: Sequence[int], max_new_tokens: int,
                stop_ids: Sequence[int]) -> Decoded:
        """Return Decoded of a decoding that replays `kind` once per verified block (which reads cache columns up to
        its anchor's position + reach) and reads stat, the block's one host sync, after each."""
        S, stops, first, tokens, done = self._start(prompt_ids, max_new_tokens, stop_ids, features=True)
        if done:
            return Decoded(tokens=tokens, forwards=1)
        gains: list[int] = []
        pos, n = S, 0
        while True:
            self._run(kind, self._width(pos + reach))
            n_ok, stopped = self.stat.tolist()  # the one host sync of a block
            gains.append(n_ok + 1)
            pos, n = pos + n_ok + 1, n + n_ok + 1
            if stopped or 1 + n >= max_new_tokens:
                break
        full = [first] + self.out[:n].tolist()
        kept, _ = cut_at_stop(full, max_new_tokens, stops)
        gains[-1] -= len(full) - len(kept)
        return Decoded(tokens=kept, forwards=1 + len(gains), accepted=gains)


class StaticDecoder(StaticLoop):
    """Greedy speculative decoding and plain greedy decoding of one target and drafter on static caches.

    max_len bounds prompt + new tokens (it sizes the caches); graphs of both paths for every width bucket are
    captured once, here, and serve every prompt. `speculative` and `greedy` return Decoded, as the dynamic loop does.
    """

    def __init__(self, target: Any, drafter: DFlashDrafter, *, max_len: int, cuda_graphs: bool | None = None,
                 sync_every: int | None = None) -> None:
        on_cuda = target.lm_head.weight.device.type == "cuda"
        self.sync_every = sync_every or (8 if on_cuda else 1)
        # Room for a whole last block and for the greedy steps run past the end before the host looks.
        super().__init__(target, drafter, max_len=max_len, room=drafter.config.block_size + self.sync_every + 1,
                         cuda_graphs=cuda_graphs)
        if self.graphs:
            self._capture_all()

    def _kinds(self) -> dict[str, Callable[[int], None]]:
        return {"block": self._block, "step": self._step}

    # ----- one step of each path, all in place on device tensors (CUDA-graph safe) -----

    def _block(self, width: int) -> None:
        drafts = self.drafter.draft(self.tok, self.pos, width)
        block = torch.cat([self.tok, drafts])
        h, feats = self.target.forward(block, self.pos, width, features=True)
        choice = self.lm_head(h).argmax(-1)  # choice[k]: the target's token after block[k]
        n_ok = (block[1:] == choice[:-1]).long().cumprod(0).sum()
        # The accepted drafts equal the target's choices, so the new tokens are choice[: n_ok + 1].
        self.drafter.add_context(feats, self.pos)
        self._advance(choice, n_ok)

    def _step(self, width: int) -> None:
        h, _ = self.target.forward(self.tok, self.pos, width)
        new = self.lm_head(h).argmax(-1)
        self.out.index_copy_(0, self.n, new)
        self.tok.copy_(new)
        self.pos.add_(1)
        self.n.add_(1)

    @torch.inference_mode()
    def speculative(self, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int] = ()) -> Any:
        """Return Decoded of greedy speculative decoding (as decode.speculative_decode at temperature 0)."""
        return self._blocks("block", self.B, prompt_ids, max_new_tokens, stop_ids)

    @torch.inference_mode()
    def greedy(self, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int] = ()) -> Any:
        """Return Decoded of plain greedy decoding (forwards: one per token, the baseline's count)."""
        S, stops, first, tokens, done = self._start(prompt_ids, max_new_tokens, stop_ids, features=False)
        pos, n = S, 0
        while not done:
            for _ in range(self.sync_every):
                self._run("step", self._width(pos + 1))
                pos += 1
            n += self.sync_every
            tokens, done = cut_at_stop([first] + self.out[:n].tolist(), max_new_tokens, stops)
        return Decoded(tokens=tokens, forwards=max(1, len(tokens)))  # the prefill runs even for 0 new tokens
