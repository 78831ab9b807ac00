"""The truncated target runner: the model's own text-model forward cut after the deepest captured layer, returning
DFlash features."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from ..errors import InputError
from ..runtime.memory import is_out_of_memory
from . import kernels
from .kernels import attention_backends
from .flops import forward_flops
from .adapter import layer_kinds, linear_attention_path, longest_window, text_config, text_model

__all__ = ["TargetRunner", "pad_batch"]

log = logging.getLogger(__name__)

# Seconds of forward the copies of rows run twice may cost before a row runs alone (_hidden): about one of the
# compilations a size of 1 asks for (~2.6 s each on one H100, one for each mask kind: bench/RESULTS.md), so a long
# run pays at most about that before it compiles, and a short one never compiles for it.
ONE_ROW_RENT_S = 3.0


class TargetRunner:
    """Runs the target's own text-model forward with its decoder layers cut after the deepest captured one (no later
    layers, no final norm, no lm_head), so every layer gets the masks, rotary embeddings and per-layer arguments the
    model's forward builds for its kind: full causal, sliding windows, attention sinks, Gated DeltaNet, MLA.

    Rows are right-padded, one sample a row: a causal layer never lets a real token see the padding after it and a
    recurrent (linear-attention) layer carries its state only forward along its own row, so no mask is passed and
    the model builds only the masks it builds without padding (none for full attention under sdpa and flash). The
    captured layers' outputs are taken by forward hooks. The feature of layer id i is decoder layer i's output,
    i.e. the full model's output_hidden_states[i + 1].
    """

    # FSDP2 (targets/sharded.py) gathers weights in hooks that inference mode breaks: its runner takes no_grad.
    grad_mode = staticmethod(torch.inference_mode)
    # Where the attention is flex, a batch of one row runs as two while the copies have cost less than flex's
    # compilation for a size of 1 would (_hidden); bench/targets.py's BENCH_ONE_ROW=1 turns it off for an A/B.
    one_row_as_two = True

    def __init__(self, model: Any, layer_ids: list[int], *, check: bool = True, check_length: int = 4096,
                 cudnn_attention: bool = False, choose_kernels: bool = True,
                 compile_layers: bool | str = False, warm_tokens: int = 0) -> None:
        where = getattr(getattr(model, "config", None), "_name_or_path", "") or "the target"
        text = text_model(model, where)
        cfg = text_config(text.config)
        self.layer_ids = list(layer_ids)
        self.depth = max(self.layer_ids) + 1
        self.kinds = layer_kinds(cfg)[: self.depth]
        self.cudnn_attention = cudnn_attention  # see attention_backends(); the benchmark compares both
        self.text = text
        if "linear_attention" in self.kinds:
            _log_linear_attention_path(cfg.model_type, text.embed_tokens.weight.device)
        # The attention and experts kernels: the fastest that equals the model's eager float32 forward (kernels.py),
        # chosen and checked by the self-check; without it, whatever the model was loaded with.
        # compile_layers: every decoder layer under torch.compile, where the self-check finds it exact (kernels.choose:
        # True or "on"; "auto": unless the target has Gated DeltaNet layers); unchecked
        # without the check, never with choose_kernels=False.
        # warm_tokens: the run's batch size; compiled layers run first on a batch of about that many tokens, rows as
        # long as the check's length allows (kernels.warm_forward), then on one row of that length; rows no longer
        # than the check's shortest (96 tokens) need no batch of their own
        # A batch of one row on flex runs as two rows of at most warm_tokens tokens (0: never) while the copies'
        # forward time stays under ONE_ROW_RENT_S (_hidden)
        self._twice_max, self._rent_s, self._rents = warm_tokens // 2, 0.0, []
        self.kernels = kernels.current(model)
        if self.kernels.attention == "flex_attention":  # loaded on flex, as a sharded target is (choose asks before
            kernels.dynamic_first(text.embed_tokens.weight.device)  # it tries flex where it chooses)
        self._compile = {True: "on", False: "off"}.get(compile_layers, compile_layers)  # type: ignore[call-overload]
        length = min(check_length, warm_tokens // 2)
        self._warm = (warm_tokens // length, length) if length > 96 else None
        reference = self._reference(model, check_length, choose_kernels) if check else None
        if self._compile == "on" and not check:
            kernels.compile_layers(text.layers[: self.depth])
            self.kernels = replace(self.kernels, compiled=True)
        # Drop what extract never runs, so its memory is free for bigger batches. The config is left whole: some
        # forwards read it for the layers they keep (Gemma 4's KV-shared layers count from the last one).
        text.layers = text.layers[: self.depth]
        text.norm = torch.nn.Identity()
        if hasattr(model, "lm_head"):
            model.lm_head = None
        self._taken: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:
            text.layers[i].register_forward_hook(self._take(i))
        self.flops = forward_flops(text, self.kinds, cfg)  # what a forward costs, for the rates' MFU
        self.hidden_size = int(cfg.hidden_size)
        self.device = text.embed_tokens.weight.device
        self.dtype = text.embed_tokens.weight.dtype
        if reference is not None:
            ids, lengths, refs, eager_refs = reference
            if eager_refs is None:
                self._compare(cfg, ids, lengths, refs)
            elif differs := self._differs(ids, lengths, refs):
                # The compiled layers passed the self-check, but the cut forward's roundings are not the ones the
                # check read (on one H100 graphs compiled apart moved a tied routing): the eager layers, held as
                # strictly to the full model's forward in them, rather than a refused target.
                log.warning("the compiled decoder layers: %s; they run eager (--compile-layers off starts that way)",
                            differs)
                kernels.compile_layers(self.text.layers, on=False)
                self.kernels = replace(self.kernels, compiled=False)
                self._compare(cfg, ids, lengths, eager_refs)
            if self.kernels.compiled:  # a batch of one row compiles once more (torch specialises a size of 1): now
                if self._warm is None:
                    self.hidden(ids[:1, : lengths[0]])
                else:
                    self.hidden(torch.randint(0, self.text.embed_tokens.weight.shape[0], (1, self._warm[1]),
                                              device=self.device))

    def _take(self, i: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            self._taken[i] = output[0] if isinstance(output, tuple) else output

        return hook

    def hidden(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Return the outputs [B, S, H] of the captured decoder layers for right-padded input_ids [B, S].

        Compiled layers that fail on a batch (a kind of batch the start-up check did not see, compiled anew, and
        torch's compiler failing on it) run eager from then on, with a warning, rather than end the run: the eager
        layers passed the same check. Every later commit record names the kernels its shard ran in."""
        try:
            return self._hidden(input_ids)
        except Exception as e:  # noqa: BLE001 - only where the layers are compiled: the eager forward decides
            if is_out_of_memory(e) or not self.kernels.compiled:
                raise  # an allocation that failed is the pipeline's to split, not a compiler's failure
            log.warning("the compiled decoder layers failed on a batch of %d x %d tokens (%s: %s); they run eager "
                        "from here on (--compile-layers off starts that way)", *input_ids.shape, type(e).__name__,
                        kernels.first_line(e))
            kernels.compile_layers(self.text.layers, on=False)
            self.kernels = replace(self.kernels, compiled=False)
            return self._hidden(input_ids)

    def _hidden(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        rows, length = input_ids.shape
        if rows == 1 and self.kernels.attention == "flex_attention" and self._twice_max:
            # torch.compile specialises a size of 1, so a run's first batch of one row compiled flex attention and
            # its block masks again for every mask kind (the gpt-oss-20b shape's recompile log on one H100,
            # bench/RESULTS.md). Such a batch runs as the row twice (rows never see each other), which the graphs
            # of larger batches take, while that costs less than the compilation: as long as the row fits a
            # batch twice and the copies' forward time comes to under ONE_ROW_RENT_S in all. Then the row runs
            # alone, flex compiles once for a size of 1, and every later row of one takes that graph.
            if self.one_row_as_two and length <= self._twice_max and self._paid() < ONE_ROW_RENT_S:
                try:
                    return [t[:1] for t in self._timed(input_ids.expand(2, -1))]
                except Exception as e:  # noqa: BLE001 - the pipeline's own test of an allocation that failed
                    if not is_out_of_memory(e):
                        raise
                    if input_ids.device.type == "cuda":
                        torch.cuda.empty_cache()
                    log.info("a row of %s tokens did not fit in memory twice; it runs alone, as rows of one do from "
                             "here on (flex attention compiles once more, for a batch of one row)", f"{length:,}")
            self._twice_max = 0
        return self._forward(input_ids)

    def _timed(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Run the forward of a doubled row, counting half its time towards the copies' rent (_paid), unless torch
        compiled during it (a first batch's dynamic shapes, which any batch would have compiled: not the copy's)."""
        cuda = input_ids.device.type == "cuda"
        graphs = kernels.graphs_compiled()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = self._forward(input_ids)
        if kernels.graphs_compiled() != graphs:
            return out
        if cuda:
            end.record()
            self._rents.append((start, end))
        else:
            self._rent_s += (time.perf_counter() - t0) / 2
        return out

    def _paid(self) -> float:
        """Return the seconds the doubled rows' copies have cost so far (CUDA's forwards once they have run)."""
        while self._rents and self._rents[0][1].query():
            start, end = self._rents.pop(0)
            self._rent_s += start.elapsed_time(end) / 2e3
        return self._rent_s

    def _forward(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        self._taken.clear()
        with self.grad_mode(), attention_backends(input_ids.device, self.cudnn_attention):
            self.text(input_ids=input_ids, use_cache=False)
        taken, self._taken = self._taken, {}
        return [taken[i] for i in self.layer_ids]

    def features(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Return the real tokens' features [sum(lengths), L, H] in bf16, padding removed, rows in order."""
        B, S = input_ids.shape
        caps = self.hidden(input_ids)
        with self.grad_mode():
            idx = torch.cat([torch.arange(n, device=input_ids.device) + b * S for b, n in enumerate(lengths)])
            feats = torch.stack([c.reshape(B * S, -1).index_select(0, idx) for c in caps], dim=1)
            return feats.to(torch.bfloat16)

    def _check_ids(self, cfg: Any, check_length: int) -> tuple[torch.Tensor, list[int]]:
        """Return the self-check's right-padded rows [2, n] and their lengths: a first row longer than every window
        (and than a Gated DeltaNet chunk), capped at the longest sample extraction runs, and a shorter second row
        with padding after it, as extraction's batches have."""
        window = longest_window(cfg, self.kinds)
        n = max(2, min(check_length, max(96, window + 32)))
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, int(cfg.vocab_size), (2, n), generator=gen)
        lengths = [n, max(1, n // 2 + 3)]
        ids[1, lengths[1]:] = 0
        return ids.to(self.text.embed_tokens.weight.device), lengths

    def _reference(self, model: Any, check_length: int,
                   choose_kernels: bool = True) -> tuple[torch.Tensor, list[int], list[torch.Tensor], Any]:
        """Return the self-check's rows, their lengths and the full model's output_hidden_states of the captured
        layers on the same rows, taken before the model is cut, in the kernels chosen for it (kernels.choose:
        the fastest whose forward equals the model's eager float32 forward; choose_kernels=False keeps the
        model's own and checks layers and positions only); where the layers are compiled, the same states with
        the layers eager (else None).

        The truncated runner is then compared with that forward in the same kernels and the same batch, so the
        same roundings: in bf16 a row run alone gives other roundings (a Qwen3.6-27B-shaped random target on one
        H200: 3% at layer 31 between a padded row and the row alone), which would refuse good targets. That
        padding never reaches a real token is what the causal kinds guarantee and tests/test_targets.py checks
        for each in fp32, against every sample run alone.
        """
        ids, lengths = self._check_ids(text_config(self.text.config), check_length)
        if choose_kernels:
            dtype = str(self.text.embed_tokens.weight.dtype).removeprefix("torch.")
            self.kernels, refs, eager = kernels.choose(model, self.text, ids, lengths, self.layer_ids, self.kinds,
                                                       dtype, compile=self._compile, warm=self._warm)
        else:
            refs = kernels.captured(kernels.model_states(model, ids, self.depth, lengths), self.layer_ids)
            eager = None
        return ids, lengths, refs, eager

    def _compare(self, cfg: Any, ids: torch.Tensor, lengths: list[int], refs: list[torch.Tensor]) -> None:
        """Refuse (InputError) unless the cut forward's rows equal the full model's on every token, padding and all."""
        differs = self._differs(ids, lengths, refs)
        if differs:
            kinds = ", ".join(sorted(set(self.kinds)))
            raise InputError(f"target {cfg.model_type} ({kinds} layers): {differs}; dflash extract cannot run this "
                             "target exactly, open an issue with its config.json")

    def _differs(self, ids: torch.Tensor, lengths: list[int], refs: list[torch.Tensor]) -> str | None:
        """Say where the cut forward's rows first differ from refs by more than 2% of their scale, or None."""
        got = self.hidden(ids)
        for b, (n, want) in enumerate(zip(lengths, refs)):
            for k, i in enumerate(self.layer_ids):
                ours, theirs = got[k][b, :n].float(), want[k].float()
                err = (ours - theirs).abs().max().item()
                scale = theirs.abs().max().item() + 1e-6
                if not err <= 2e-2 * scale:
                    return (f"the truncated forward's layer {i} differs from the full model's "
                            f"output_hidden_states[{i + 1}] by {err:.3g} (scale {scale:.3g}) on a "
                            f"{'padded ' if b else ''}row of {n} tokens")
        return None


def _log_linear_attention_path(model_type: str, device: torch.device) -> None:
    """Log which Gated DeltaNet kernels the target's linear-attention layers run; warn when a CUDA run has only
    transformers' torch fallback."""
    fla = linear_attention_path()
    if fla is not None:
        log.info("%s: Gated DeltaNet layers run flash-linear-attention %s's kernels%s", model_type, fla,
                 "; on a machine that has not run them yet they compile and autotune on the first batches (80 s on "
                 "one H200 for a Qwen3.6-27B shape, once: later runs find them in Triton's cache)"
                 if device.type == "cuda" else "")
    elif device.type == "cuda":
        log.warning("%s: Gated DeltaNet layers run transformers' torch fallback (flash-linear-attention is not "
                    "installed; its kernels ran a Qwen3.6-27B-shaped forward 1.45x faster on one H200): "
                    "pip install 'dflash[hybrid]'", model_type)
    else:
        log.info("%s: Gated DeltaNet layers run transformers' torch fallback", model_type)


def pad_batch(samples: list[Any], pad_id: int) -> tuple[torch.Tensor, list[int]]:
    """Return right-padded int64 ids [B, max_len] of the samples' input_ids, and their lengths."""
    lengths = [len(s) for s in samples]
    out = torch.full((len(samples), max(lengths)), pad_id, dtype=torch.long)
    for b, s in enumerate(samples):
        out[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out, lengths
