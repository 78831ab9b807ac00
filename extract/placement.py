"""Where the target's weights live during extraction, decided once from numbers: a whole copy on every GPU (today's
path), one copy shared by K GPUs (FSDP2), or shards in pinned host memory; and the batch size that goes with it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, InputError
from .plan import format_bytes

__all__ = ["batch_floor", "min_shard_tokens", "SHARDED_SHARD_BATCHES", "is_sharded", "target_size",
           "RESIDENT_BATCH_TOKENS", "SHARDED_BATCH_TOKENS", "GPU_USABLE", "HOST_USABLE", "Placement", "TargetSize",
           "activation_bytes", "decide", "placement_of"]

# The batch of a target whose weights stay on the GPU, and of one whose weights are streamed in layer by layer:
# measured on one H200 (DESIGN.md, "Targets larger than a GPU"), a host-offloaded Qwen3-32B-shaped stack ran at
# 0.653 / 0.908 / 0.956 of resident at 16K / 64K / 128K tokens a forward: 64K makes the weight traffic small.
RESIDENT_BATCH_TOKENS = 32768
SHARDED_BATCH_TOKENS = 65536
# Shares of the free GPU memory and of the available host memory a plan may count on (the allocator's
# fragmentation, CUDA graphs of attention kernels, the pinned feature buffers, the page cache of the weights).
GPU_USABLE = 0.85
HOST_USABLE = 0.8
# Weights streamed from host memory cross the host link once a forward, layer by layer, each copy hidden behind the
# layer before: a batch must make one layer's compute outlast one layer's copy. The compute is estimated at
# STREAM_MFU of the device's dense bf16 peak (high for MoE targets, which reach 15-35%, so the batch errs large), and
# must take STREAM_MARGIN times the copy. The batch doubles from SHARDED_BATCH_TOKENS up to MAX_STREAMED_BATCH while
# the GPU and host memory hold it.
STREAM_MFU = 0.5
STREAM_MARGIN = 1.25
MAX_STREAMED_BATCH = 8 * SHARDED_BATCH_TOKENS
# A forward of a sharded or offloaded target costs at least this share of its batch, whatever the batch holds: its
# weights cross to the device once a forward (all-gathered from peers, or copied from host memory, hidden behind the
# compute only where a layer computes longer than it copies: about 11K tokens over an H100's or H200's PCIe 5 link at
# half its peak, bench/RESULTS.md). Packing a shard's samples into batches counts it (plan.pack_batches), so they go
# in fewer, fuller forwards: without it a 400K-token shard went in 49 forwards of 5-12K tokens, each a whole pass of
# the weights, and the offloaded Qwen3-32B shape ran at 0.80 of resident; with it, 0.952 (6.5% padding against 1.1%).
SHARDED_BATCH_FLOOR = 0.25
# A sharded or offloaded target's default shards hold at least this many of its batches (a forward never spans two
# shards, and each shard is packed on its own). Under the floor, the fewer rows a shard has, the more of its forwards
# mix long and short rows: on lognormal rows of 193-4,001 tokens at 65,536 a batch (a CPU model of pack_batches, the
# cost of a forward the larger of its padded tokens and a 9K-token copy pass, which put the bench's run at 0.944
# where the H200 measured 0.952), shards of 2 batches pad 11.4% and cost 1.121x their tokens, of 4 batches 6.3% and
# 1.070x, of 8 batches 3.4% and 1.041x. Four: a shard that a kill loses is then still under a minute of a 32B
# target's forwards.
SHARDED_SHARD_BATCHES = 4
# A batch grown past the default counts its activations this many times over: the estimate below is rough (MoE
# routing buffers exceed it), and a batch too large for the GPU is split only where no peer waits in its forward.
_GROWN_ACTIVATIONS = 1.5
# The pipeline's pinned host buffers of features, each a batch's (extract/pipeline.py's NUM_BUFFERS), each rounded
# up to a power of two by torch's pinned allocator.
_FEATURE_BUFFERS = 3
# Bytes an activation of one token costs beyond the features kept, in units of (compute dtype bytes x width):
# the residual and its norm, q/k/v/o, the MLP's gate, up and product. An estimate; transformers' kernels differ.
_ACT_HIDDEN, _ACT_INTERMEDIATE = 8, 3


@dataclass(frozen=True)
class TargetSize:
    """A target in bytes at the compute dtype: all its weights as a run loads them, its embedding, its largest layer
    among those extraction runs, and one token's activations."""

    params: int
    embed: int
    layer: int
    token_activation: int
    captured_layers: int
    feature_token: int  # bytes of one token's features as the pipeline keeps them (bf16)
    bytes_per_flop: float = 0.0  # a run layer's weight bytes per FLOP a token costs in it, the most of any (0: unknown)


def target_size(counts: dict[str, int], captured: int) -> TargetSize:
    """Return the TargetSize of target.sharded.captured_size's counts, `captured` layers kept as features."""
    token = counts["dtype_bytes"] * (_ACT_HIDDEN * counts["hidden"] + _ACT_INTERMEDIATE * counts["width"])
    return TargetSize(params=counts["params"], embed=counts["embed"], layer=counts["layer"], token_activation=token,
                      captured_layers=captured, feature_token=captured * counts["hidden"] * 2,
                      bytes_per_flop=float(counts.get("bytes_per_flop", 0.0)))


def activation_bytes(size: TargetSize, batch_tokens: int) -> int:
    """Return the estimated GPU bytes of one forward's activations over a batch of batch_tokens tokens."""
    return batch_tokens * (size.token_activation + size.feature_token)


@dataclass(frozen=True)
class Placement:
    """Where the weights of one run live: `shard` ranks share one copy (1: every rank holds it whole), in pinned host
    memory when `offload`; with the batch size and the sentence the log and --dry-run print."""

    shard: int
    offload: bool
    batch_tokens: int
    reason: str

    @property
    def sharded(self) -> bool:
        """Return True if the weights run under FSDP2 (shared by several ranks, or offloaded to host memory)."""
        return self.shard > 1 or self.offload

    def line(self) -> str:
        """Return the one line that says what was chosen and why."""
        if not self.sharded:
            where = "a whole copy of the target on every device"
        else:
            where = (f"the target's weights sharded over {self.shard} rank(s)" if self.shard > 1
                     else "the target's weights on one rank")
            where += ", held in pinned host memory" if self.offload else ""
            return (f"weights: {where}, batches of {self.batch_tokens:,} tokens ({self.reason}); samples packed as "
                    f"if a forward held at least {_floor(self.batch_tokens):,} tokens, since the weights cross once a "
                    f"forward")
        return f"weights: {where}, batches of {self.batch_tokens:,} tokens ({self.reason})"


def _batch(asked: int | None, sharded: bool) -> int:
    return asked if asked is not None else (SHARDED_BATCH_TOKENS if sharded else RESIDENT_BATCH_TOKENS)


def streamed_batch(size: TargetSize, shard: int, *, link: float | None, device_flops: float | None,
                   free: int | None, host_free: int | None, local_world: int = 1) -> tuple[int, str]:
    """Return (the batch of a target streamed from host memory, the words that say why) when no --batch-tokens was
    asked: SHARDED_BATCH_TOKENS, doubled while one layer's compute at STREAM_MFU of device_flops would not outlast
    STREAM_MARGIN times the copy of its share (1/shard) of the layer over `link` (bytes/s of a host-to-GPU copy), up
    to MAX_STREAMED_BATCH and as far as the GPU (free) and the node's host memory (host_free: local_world ranks, a
    copy of the weights for every `shard` of them, each rank's feature buffers) hold it. Without a link, a device
    peak or the target's bytes per FLOP, SHARDED_BATCH_TOKENS."""
    batch = SHARDED_BATCH_TOKENS
    if not (link and device_flops and size.bytes_per_flop):
        return batch, ""
    need = STREAM_MARGIN * size.bytes_per_flop / shard * device_flops * STREAM_MFU / link

    def fits(b: int) -> bool:
        gpu = size.embed + 2 * size.layer + _GROWN_ACTIVATIONS * activation_bytes(size, b)
        buffer = 1 << max(0, (b * size.feature_token - 1).bit_length())
        host = size.params * max(1, local_world) / shard + max(1, local_world) * _FEATURE_BUFFERS * buffer
        return ((free is None or gpu <= free * GPU_USABLE) and (host_free is None or host <= host_free * HOST_USABLE))

    while batch < need and batch < MAX_STREAMED_BATCH and fits(2 * batch):
        batch *= 2
    copy_ms = size.layer / shard / link * 1e3
    short = "" if batch >= need else (f", short of the {int(need):,} that would hide it" +
                                      (" (the most tokens the GPU and host memory hold)"
                                       if batch < MAX_STREAMED_BATCH else f" (capped at {MAX_STREAMED_BATCH:,})"))
    return batch, (f"; the largest layer's copy takes {copy_ms:.0f} ms over the host link ({link / 1e9:.1f} GB/s "
                   f"measured), and at {STREAM_MFU:.0%} of the device's peak a batch of {batch:,} tokens computes a "
                   f"layer in about {batch / need * STREAM_MARGIN:.1f}x its copy's time{short}")


def _shards(local_world: int, world: int) -> list[int]:
    """Return the candidate numbers of ranks sharing a copy, fewest first: divisors of a node's ranks, then whole
    nodes (multiples of a node's ranks that divide the run's)."""
    node = [k for k in range(2, local_world + 1) if local_world % k == 0 and world % k == 0]
    across = [k for k in range(2 * local_world, world + 1, local_world) if world % k == 0]
    return node + across


def decide(asked: int | None, offload: bool, size: TargetSize, *, free: int | None, host_free: int | None,
           local_world: int, world: int, batch_tokens: int | None, on_gpu: bool, where: str = "--model",
           link: float | None = None, device_flops: float | None = None) -> Placement:
    """Return the Placement of a run: `asked` is --shard-weights (None: auto), `offload` --offload cpu; free is the
    least free memory of the run's GPUs (None: unknown), host_free a node's available host memory; link the
    measured bytes/s of a host-to-GPU copy and device_flops the GPU's dense bf16 peak, which size the batch of
    weights streamed from host memory (streamed_batch; None: SHARDED_BATCH_TOKENS).

    auto keeps today's path (a whole copy per GPU) while the captured layers and a batch fit one GPU; else it takes
    the fewest GPUs of a node whose shares fit (each also holds the embedding, which stays gathered, and two layers
    gathered at once: the one running and the one prefetched), then whole nodes, then host memory (one copy a node,
    shared by its ranks).
    """
    if asked is not None and world % asked:
        raise ConfigError(f"--shard-weights {asked}: expected a number of ranks that divides the run's {world}; pass "
                          f"one of {', '.join(str(k) for k in range(1, world + 1) if world % k == 0)}, or auto")
    gb = format_bytes
    what = f"the target's weights are {gb(size.params)}"
    tail = f"; {what}" if size.params else ""  # not counted (a CPU run's auto): nothing to say
    if asked is not None:
        if offload and on_gpu and batch_tokens is None:
            batch, why = streamed_batch(size, asked, link=link, device_flops=device_flops, free=free,
                                        host_free=host_free, local_world=local_world)
            return Placement(asked, True, batch, f"asked{tail}{why}")
        return Placement(asked, offload, _batch(batch_tokens, asked > 1 or offload), f"asked{tail}")
    if not on_gpu:
        return Placement(1, False, _batch(batch_tokens, False),
                         f"auto: the target runs on the CPU, whose memory holds it whole{tail}")
    if offload:
        k = local_world if world % local_world == 0 else 1
        batch, why = (batch_tokens, "") if batch_tokens is not None else streamed_batch(
            size, k, link=link, device_flops=device_flops, free=free, host_free=host_free, local_world=local_world)
        return Placement(k, True, batch,
                         f"auto with --offload cpu: one copy in each node's host memory, shared by its {k} rank(s)"
                         f"{tail}{why}")
    if free is None:
        return Placement(1, False, _batch(batch_tokens, False),
                         f"auto: the GPUs' free memory is unknown here, so a whole copy per GPU{tail}")
    usable = int(free * GPU_USABLE)
    whole = size.params + activation_bytes(size, _batch(batch_tokens, False))
    if whole <= usable:
        return Placement(1, False, _batch(batch_tokens, False),
                         f"auto: {what}, a batch needs {gb(whole - size.params)} more, {gb(free)} free on the GPU")
    act = activation_bytes(size, _batch(batch_tokens, True))
    for k in _shards(local_world, world):
        need = (size.params - size.embed) // k + size.embed + 2 * size.layer + act
        if need <= usable:
            return Placement(k, False, _batch(batch_tokens, True),
                             f"auto: {what} and a batch {gb(act)}, more than the {gb(free)} free on one GPU; shared by "
                             f"{k} GPUs each needs {gb(need)}")
    need = size.embed + 2 * size.layer + act
    if need > usable:
        raise InputError(f"{where}: even streamed from host memory a forward needs {gb(need)} of GPU memory (the "
                         f"embedding, two layers of {gb(size.layer)}, a batch's activations) and the GPU has "
                         f"{gb(free)} free; lower --batch-tokens, or free the GPUs")
    k = local_world if world % local_world == 0 else 1
    if host_free is not None and size.params > host_free * HOST_USABLE:  # one copy a node, shared by its ranks
        raise InputError(f"{where}: {what}, more than {world} GPU(s) can hold ({gb(free)} free each) and more than "
                         f"this node's {gb(host_free)} of available host memory; run on more GPUs or nodes (torchrun), "
                         "or lower --layers")
    batch, why = (batch_tokens, "") if batch_tokens is not None else streamed_batch(
        size, k, link=link, device_flops=device_flops, free=free, host_free=host_free, local_world=local_world)
    return Placement(k, True, batch,
                     f"auto: {what}, more than {world} GPU(s) hold with {gb(free)} free each; streamed from pinned "
                     f"host memory ({gb(host_free)} available), one copy a node shared by {k} rank(s){why}")


def placement_of(cfg: Any, size: TargetSize | None, *, free: int | None, host_free: int | None, local_world: int,
                 world: int, on_gpu: bool, link: float | None = None, device_flops: float | None = None) -> Placement:
    """Return the Placement of an ExtractConfig (its --shard-weights, --offload and --batch-tokens)."""
    from ..config.options import parse_shard_weights

    asked = parse_shard_weights(cfg.shard_weights)
    if size is None:  # nothing measured: only what was asked can be honoured
        size = TargetSize(0, 0, 0, 0, 0, 0)
    return decide(asked, cfg.offload == "cpu", size, free=free, host_free=host_free, local_world=local_world,
                  world=world, batch_tokens=cfg.batch_tokens, on_gpu=on_gpu, where=f"--model {cfg.model}", link=link,
                  device_flops=device_flops)


def batch_floor(cfg: Any) -> int:
    """Return the tokens a forward of an ExtractConfig's target counts at least when its samples are packed into
    batches: SHARDED_BATCH_FLOOR of --batch-tokens for a sharded or offloaded target (its weights cross once a
    forward), else 0."""
    if not is_sharded(cfg) or cfg.batch_tokens is None:
        return 0
    return _floor(cfg.batch_tokens)


def _floor(batch_tokens: int) -> int:
    return int(batch_tokens * SHARDED_BATCH_FLOOR)


def min_shard_tokens(placement: "Placement | None", total_tokens: int, world: int) -> int:
    """Return the fewest tokens a default shard holds: for a sharded or offloaded target SHARDED_SHARD_BATCHES of its
    batches, fewer (down to two) where the data (total_tokens, an estimate) would then give each of the run's `world`
    ranks fewer than about four shards: ranks that share weights forward in lockstep, so the run lasts as long as its
    busiest rank, and smaller shards share the last of the work out more evenly; 0 (the 2 GiB default alone) for a
    resident target."""
    if placement is None or not placement.sharded:
        return 0
    batch = placement.batch_tokens
    even = int(total_tokens) // (4 * world) if world > 1 else SHARDED_SHARD_BATCHES * batch
    return max(2 * batch, min(SHARDED_SHARD_BATCHES * batch, even))


def is_sharded(cfg: Any) -> bool:
    """Return True if a resolved ExtractConfig runs the target sharded or offloaded (FSDP2); auto counts as not yet."""
    from ..config.options import parse_shard_weights

    return (parse_shard_weights(cfg.shard_weights) or 1) > 1 or cfg.offload == "cpu"
