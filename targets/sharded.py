"""The target with its weights sharded over ranks (FSDP2) or held in pinned host memory: the process group, the
sharded load (each rank reads only its part of each tensor), and the runner that forwards through it.

The load is transformers' own `from_pretrained(distributed_config=...)`: it builds the model on the meta device,
applies `fully_shard` to every decoder layer and to the text stack, and reads each checkpoint tensor through its
key mapping and weight conversions with `DtensorShardOperation`, which slices the safetensors on read (per-expert
tensors a rank does not own are not read at all). A rank whose shard is itself alone (one GPU with its weights in
host memory) needs no FSDP2: its model loads into host memory and targets/streamed.py streams its layers to the GPU
a layer ahead of the forward (FSDP2 on a world of one copies each layer on the compute stream, with no overlap).
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch

from .adapter import text_config, text_model
from .kernels import accepts, attention_backends
from .runner import TargetRunner

__all__ = ["release_group", "init_group", "load_sharded", "ShardedRunner", "captured_size", "text_path"]

log = logging.getLogger(__name__)


def init_group(device: torch.device, timeout_s: int) -> None:
    """Join the run's process group (torchrun's or dflash's launcher's rendezvous; a store of its own for a world of
    one). CPU tensors go through gloo, CUDA ones NCCL. Its collectives give up a minute after timeout_s: before
    then extract.lockstep's watchdog ends a rank that waited timeout_s with one line (NCCL's own timeout aborts)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s + 60)
    if "MASTER_ADDR" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def release_group() -> None:
    """Leave the process group, if this process joined one (the end of a command: a test's process runs more)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def text_path(model: Any) -> str:
    """Return the dotted name of the text decoder stack inside a causal LM (model, model.language_model)."""
    text = text_model(model)
    for name, module in model.named_modules():
        if module is text:
            return name
    raise AssertionError("the text stack is a submodule of its model")


def _dtype_bytes(dtype: Any) -> int:
    return torch.empty((), dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).element_size()


def captured_size(model_config: Any, depth: int, dtype: str) -> dict[str, int]:
    """Return the sizes the placement of a target is decided from, counted on the meta device (no weight is read):
    its weights in `dtype` as a run loads them (every parameter: the layers past the first `depth`, which
    extraction runs, are dropped only after the load), what stays on the GPU outside the decoder layers ("embed")
    and its largest run layer in bytes, its hidden width, its MLP width (for MoE: the experts a token takes,
    together), the dtype's bytes and the run layers' most weight bytes per FLOP a token."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
    finally:
        hf_logging.set_verbosity(verbosity)
    text = text_model(model)
    size = _dtype_bytes(dtype)
    cfg = text_config(model_config)
    inter = int(getattr(cfg, "intermediate_size", None) or 0)
    moe = int(getattr(cfg, "moe_intermediate_size", None) or 0) * int(getattr(cfg, "num_experts_per_tok", None) or 0)
    params = sum(p.numel() for p in model.parameters())
    layers = sum(p.numel() for layer in text.layers for p in layer.parameters())
    head = getattr(model, "lm_head", None)
    untied = head is not None and getattr(head, "weight", None) is not None and \
        head.weight is not text.embed_tokens.weight
    return {"params": params * size,
            # what stays on the GPU beside the layers: the embedding, the final norm, a wrapper's other towers (an
            # untied lm_head is never run by extraction, so never gathered or moved there)
            "embed": (params - layers - (head.weight.numel() if untied else 0)) * size,
            "layer": max((sum(p.numel() for p in layer.parameters()) * size for layer in text.layers[:depth]),
                         default=0),
            "hidden": int(cfg.hidden_size), "width": max(inter, moe), "dtype_bytes": size,
            "bytes_per_flop": _bytes_per_flop(text, cfg, depth, size)}


def _bytes_per_flop(text: Any, cfg: Any, depth: int, size: int) -> float:
    """Return the most weight bytes per FLOP a token costs of any decoder layer extraction runs (the first `depth`):
    what a layer streamed to the GPU moves against the compute that can hide it. Attention's own score FLOPs, which
    grow with the row, are left out (the compute is under-counted, so a batch chosen from it errs large). An MoE layer
    moves every expert and computes top_k of them: its figure is E / top_k times a dense layer's."""
    from .adapter import layer_kinds
    from .flops import forward_flops

    worst = 0.0
    for layer, kind in zip(text.layers[:depth], layer_kinds(cfg)[:depth]):
        holder = torch.nn.Module()
        holder.layers = torch.nn.ModuleList([layer])
        flops = sum(forward_flops(holder, [kind], cfg).per_token.values())
        if flops > 0:
            worst = max(worst, sum(p.numel() for p in layer.parameters()) * size / flops)
    return worst


def _plan(model: Any, path: str) -> dict[str, str]:
    """Return the FSDP plan: every decoder layer a unit freed after its forward, and an untied lm_head a unit of its
    own that is never called (so never gathered); the rest (embedding, final norm) is the root's, which FSDP keeps
    gathered after the first forward."""
    plan = {f"{path}.layers.*": "free_full_weight"}
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is text_model(model).embed_tokens.weight
    if head is not None and not tied:
        plan["lm_head"] = "free_full_weight"
    return plan


def _distributed_config() -> Any:
    """Return transformers' DistributedConfig, which loads a model sharded by FSDP2; InputError naming the version
    to install when this transformers has none."""
    import transformers

    from ..errors import InputError

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        DistributedConfig = None
    if DistributedConfig is None or "fsdp_plan" not in getattr(DistributedConfig, "__dataclass_fields__", {}):
        raise InputError(f"--shard-weights / --offload cpu: expected a transformers that loads a model sharded by "
                         f"FSDP2 (DistributedConfig with fsdp_plan), found transformers {transformers.__version__}; "
                         "pip install 'transformers>=5.25'")
    return DistributedConfig


def _prefetch_next(text: Any) -> None:
    """Have each decoder layer's forward start the next layer's all-gather (or host copy) before it runs."""
    from torch.distributed.fsdp import FSDPModule

    layers = [m for m in text.layers if isinstance(m, FSDPModule)]
    for here, nxt in zip(layers, layers[1:]):
        here.set_modules_to_forward_prefetch([nxt])


def load_sharded(model_dir: str | os.PathLike, device: torch.device, dtype: str, shard: int, offload: bool) -> Any:
    """Return the target's causal LM in eval mode with its weights sharded over `shard` ranks of the process group
    (replicated over the rest), in pinned host memory when `offload` (on CUDA: on the CPU they are there already);
    every rank reads only its part of each tensor. With offload and a shard of one rank the rank holds a whole copy
    in host memory instead, whose decoder layers stream to the device a layer ahead of the forward (its
    LayerStream is the model's `dflash_stream`). init_group() first."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from .adapter import attention_for

    from .load import causal_lm, hub_kernels_requested

    world = dist.get_world_size()
    config = AutoConfig.from_pretrained(os.fspath(model_dir))
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "attn_implementation": attention_for(config, device),
                              # no Hub kernels unless asked: a sharded target runs the same code as a resident one
                              "use_kernels": hub_kernels_requested()}
    if shard == 1:  # --offload cpu (else the target is not sharded): a copy in host memory, streamed a layer ahead
        from .streamed import stream_layers

        model = causal_lm(model_dir, **kwargs)
        model.dflash_stream = stream_layers(model, text_model(model), device)
        return model.eval()
    DistributedConfig = _distributed_config()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    path, plan = text_path(meta), _plan(meta, text_path(meta))
    if device.type == "cuda":
        # transformers binds the device of LOCAL_RANK: the one --gpus gave this rank
        os.environ["LOCAL_RANK"] = str(device.index or 0)
    kwargs["distributed_config"] = DistributedConfig(
        fsdp_size=shard, dp_replicate_size=world // shard, fsdp_plan=plan,
        fsdp_cpu_offload=offload and device.type == "cuda")
    model = causal_lm(model_dir, **kwargs)
    model.eval()
    text = model.get_submodule(path)
    log.info("target %s: %d decoder layers sharded over %d of %d rank(s)%s; this rank holds %d bytes of weights",
             model_dir, len(text.layers), shard, world,
             " in pinned host memory" if offload and device.type == "cuda" else "", bytes_of(model))
    return model


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


class ShardedRunner(TargetRunner):
    """The truncated runner over a sharded target: FSDP2's hooks need no_grad (not inference mode), and every
    forward enters through the causal LM (the FSDP root, which gathers the embedding) with its lm_head an identity
    (its shards are never gathered); the decoder layers past the deepest captured one are cut as in TargetRunner, and
    each remaining layer prefetches the next."""

    grad_mode = staticmethod(torch.no_grad)

    def __init__(self, model: Any, layer_ids: list[int], device: torch.device, *, check_length: int = 4096) -> None:
        from .load import check_finite

        named = ((n, _local(p)) for n, p in model.named_parameters())
        check_finite(named, getattr(model.config, "_name_or_path", "the target"))
        self._compute = device  # the weights may live in host memory; the forward runs here
        self.model = model
        model.lm_head = torch.nn.Identity()
        self._kwargs = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
        self._cut = False
        # Under FSDP2 the model's own kernels, checked for layers and positions: kernels.choose would recast its
        # sharded weights to float32 for its reference, and each rank must run the same forwards in step. A rank
        # streaming its own copy has no peers and whole layers on the device: it chooses them as a resident target.
        streamed = getattr(model, "dflash_stream", None) is not None
        super().__init__(model, layer_ids, check=True, check_length=check_length, choose_kernels=streamed)
        model.lm_head = torch.nn.Identity()
        self._cut = True
        _prefetch_next(self.text)
        self.weight_stream = getattr(model, "dflash_stream", None)  # targets/streamed.py: a copy in host memory
        if self.weight_stream is not None:
            self.weight_stream.trim()  # the layers past the deepest captured one leave host memory too
        self.device = device
        self.dtype = _local(self.text.embed_tokens.weight).dtype

    def _check_ids(self, cfg: Any, check_length: int) -> tuple[torch.Tensor, list[int]]:
        ids, lengths = super()._check_ids(cfg, check_length)
        return ids.to(self._compute), lengths

    def hidden(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Return the outputs [B, S, H] of the captured decoder layers for right-padded input_ids [B, S]."""
        if not self._cut:  # the self-check's cut forward runs before __init__ has restored the identity head
            self.model.lm_head = torch.nn.Identity()
        self._taken.clear()
        with self.grad_mode(), attention_backends(input_ids.device, self.cudnn_attention):
            self.model(input_ids=input_ids, use_cache=False, **self._kwargs)
        taken, self._taken = self._taken, {}
        return [taken[i] for i in self.layer_ids]


def bytes_of(model: Any) -> int:
    """Return the bytes of this rank's share of the model's weights."""
    return sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
