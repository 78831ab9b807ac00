"""Streaming a round's plan from the store: shards read ahead (prefetch.py), packed batches ahead on a thread.

One reader thread reads whole shards (large sequential reads; the store decodes chunks in its own pool) in the
order this rank first needs them, at most `depth` shards ahead of what the current steps hold. One producer
thread turns each step's samples into PackedBatches on the training device, copying from pinned memory on a side
stream, so the training loop only waits when the disk is slower than the GPU.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..storage.device_codec import decode_on_device
from .plan import Round, Sample, batch_seed
from .prefetch import ShardPrefetcher, Stopped

if TYPE_CHECKING:
    import torch

    from ..config import TrainConfig
    from ..drafter.config import DrafterConfig
    from ..storage import Store
    from ..drafter.batch import PackedBatch

__all__ = ["StreamSpec", "RoundStream", "RoundStreams", "StepData"]

log = logging.getLogger(__name__)

_END = object()


@dataclass
class StepData:
    """The micro-batches of one step for this rank (None where every sample came from a skipped corrupt shard)."""

    step_in_epoch: int
    micro: list["PackedBatch | None"]
    tokens: int
    skipped_samples: int


@dataclass(frozen=True)
class StreamSpec:
    """What a rank's streams share for the whole run: its slots, how samples become batches, and the reading."""

    slots: list[int]
    seed: int
    block_size: int
    mask_token_id: int
    anchors: int
    max_blocks: int | None
    device: "torch.device"
    depth: int = 2  # whole shards read ahead beyond what the current steps hold
    skip_corrupt: bool = False
    ahead: int = 2  # steps of batches built ahead
    # Where a scaled codec's features (fp8, uq) are decoded: on the training device (None: on CUDA), from the
    # stored codes copied there, or in the store's read pool. On an H200 the pool's numpy decoding held the GIL the
    # training loop needs so often that a uq6 store trained at 0.43x a blosc store's steps a second.
    device_decode: bool | None = None

    @classmethod
    def of_run(cls, cfg: "TrainConfig", dcfg: "DrafterConfig", dist: Any) -> "StreamSpec":
        """Return the spec of this rank's streams in a `dflash train` run (its slots: rank x grad-accum onwards)."""
        from .packing import max_blocks_for

        return cls(slots=list(range(dist.rank * cfg.grad_accum, (dist.rank + 1) * cfg.grad_accum)), seed=cfg.seed,
                   block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id, anchors=cfg.anchors,
                   max_blocks=max_blocks_for(cfg.batch_tokens), device=dist.device, depth=cfg.prefetch_shards,
                   skip_corrupt=cfg.skip_corrupt)


def _schedule(plan: Round, slots: list[int], steps: range) -> tuple[list[int], dict[int, int], int]:
    """Return (shards in order of first use, last step using each, most shards any step range holds at once)."""
    order: list[int] = []
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for s in steps:
        for batch in (plan.batches[k][s] for k in slots):
            for sid, _, _ in batch:
                if sid not in first:
                    first[sid] = s
                    order.append(sid)
                last[sid] = s
    # Shards first used at or before step s and last used at or after it are held together: sweep the steps.
    events = sorted([(first[sid], 1) for sid in order] + [(last[sid] + 1, -1) for sid in order])
    live = held = 1 if not order else 0
    for _, delta in events:
        held += delta
        live = max(live, held)
    return order, last, live


class RoundStream:
    """Iterator over StepData of this rank's slots for steps start..round.steps-1 of one round.

    `ahead` is (a prefetcher, the number of its round that reads this round's shards) handed over by RoundStreams
    from the round before; without it the stream starts its own prefetcher.
    """

    def __init__(self, store: "Store", plan: Round, spec: StreamSpec, *, epoch: int, step_offset: int,
                 start: int, ahead: "tuple[ShardPrefetcher, int] | None" = None) -> None:
        self.plan, self.spec, self.epoch, self.offset = plan, spec, epoch, step_offset
        self.slots, self.device = spec.slots, spec.device
        self.steps = range(start, plan.steps)
        order, last_use, live = _schedule(plan, self.slots, self.steps)
        self.order, self.last_use = order, last_use
        if ahead is None:
            cuda = spec.device.type == "cuda"
            self.prefetch = ShardPrefetcher(store, order, live + spec.depth, spec.skip_corrupt, cuda,
                                             raw=cuda if spec.device_decode is None else spec.device_decode)
            self.rnd = 0
        else:
            self.prefetch, self.rnd = ahead
            self.prefetch.advance(live + spec.depth)
        self.owns = True  # False once the prefetcher is handed on to the next round's stream
        self.queue: queue.Queue = queue.Queue(maxsize=spec.ahead)
        self.error: BaseException | None = None
        self.ended = False  # every step was yielded
        self.thread = threading.Thread(target=self._produce, name="dflash-batches", daemon=True)
        self.thread.start()

    def _step_samples(self, s: int) -> list[list[Sample]]:
        return [self.plan.batches[k][s] for k in self.slots]

    def _pack(self, samples: list[Sample], s: int, slot: int) -> tuple["PackedBatch | None", int]:
        from .packing import pack_batch

        seqs, skipped = [], 0
        for sid, idx, n in samples:
            data = self.prefetch.get(sid, self.rnd)
            if data is None:
                skipped += 1
                continue
            ids, mask, feats = data.sample(idx)
            feats, scales = feats[:n], data.sample_scales(idx)
            if self.device.type == "cuda":
                feats = feats.to(self.device, non_blocking=True)
            if scales is not None:  # stored codes: decoded here, on the training device
                feats = decode_on_device(feats, scales[:n].to(feats.device, non_blocking=True), data.codec)
            seqs.append({"input_ids": ids[:n], "loss_mask": mask[:n], "features": feats})
        if not seqs:
            return None, skipped
        spec = self.spec
        batch = pack_batch(seqs, block_size=spec.block_size, mask_token_id=spec.mask_token_id, max_anchors=spec.anchors,
                           max_blocks=spec.max_blocks, seed=batch_seed(spec.seed, self.epoch, self.offset + s, slot))
        if self.device.type != "cuda":
            batch = batch.to(self.device)
        return batch, skipped

    def _produce(self) -> None:
        import torch

        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            for s in self.steps:
                micro, skipped, tokens = [], 0, 0
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for slot, samples in zip(self.slots, self._step_samples(s)):
                        batch, sk = self._pack(samples, s, slot)
                        micro.append(batch)
                        skipped += sk
                        tokens += sum(x[2] for x in samples)
                if stream is not None:
                    stream.synchronize()  # copies done: the pinned shard memory may be released now
                for sid in {x[0] for batch in self._step_samples(s) for x in batch}:
                    if self.last_use[sid] == s:
                        self.prefetch.release(sid, self.rnd)
                self.queue.put(StepData(self.offset + s, micro, tokens, skipped))
        except Stopped:
            pass
        except BaseException as e:
            self.error = e
        finally:
            self.queue.put(_END)

    def __iter__(self) -> "RoundStream":
        return self

    def __next__(self) -> StepData:
        item = self.queue.get()
        if item is _END:
            self.queue.put(_END)
            if self.error is not None:
                raise self.error
            self.ended = True
            raise StopIteration
        if self.device.type == "cuda":
            import torch

            # Made on the side stream, used and freed on the training stream: tell the allocator.
            current = torch.cuda.current_stream(self.device)
            for batch in item.micro:
                for name in batch.__dataclass_fields__ if batch is not None else ():
                    getattr(batch, name).record_stream(current)
        return item

    def get(self) -> tuple[StepData | None, float]:
        """Return (next step's data or None at the end, seconds spent waiting for it)."""
        t0 = time.perf_counter()
        try:
            item = next(self)
        except StopIteration:
            item = None
        return item, time.perf_counter() - t0

    @property
    def corrupt(self) -> list[int]:
        """Return the ids of the corrupt shards skipped so far."""
        return list(self.prefetch.corrupt)

    def depth(self) -> int:
        """Return how many shards are read ahead and waiting."""
        return self.prefetch.depth()

    def close(self) -> None:
        """Stop the threads (used when training stops before the round ends); a prefetcher handed on is kept."""
        if not self.owns:
            self.thread.join()
            return
        self.prefetch.close()
        while self.thread.is_alive():
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
            self.prefetch.close()


class RoundStreams:
    """A run's streams, one round after another; told the next round, the current stream reads its shards ahead.

    The next round's order is queued on the current round's prefetcher, which begins it as soon as its own reads
    have all begun and a slot is free (same bound: at most the current round's shards in flight), and the next
    stream takes that prefetcher over, so an epoch or round boundary does not start cold. Batches do not depend on
    it: a stream packs the same samples whoever read its shards; an order that does not match is dropped.
    """

    def __init__(self, store: "Store", spec: StreamSpec) -> None:
        self.store, self.spec = store, spec
        self.stream: RoundStream | None = None
        self.ahead: tuple[list[int], ShardPrefetcher, int] | None = None  # (order, prefetcher, its round)
        self.handed = 0  # rounds that started with shards read ahead (for tests and logs)

    def open(self, plan: Round, *, epoch: int, step_offset: int, start: int) -> RoundStream:
        """Return the stream of one round, taking over the shards read ahead for it, if any."""
        ahead, self.ahead = self.ahead, None
        take = None
        if ahead is not None:
            order, pf, rnd = ahead
            if order == _schedule(plan, self.spec.slots, range(start, plan.steps))[0]:
                take = (pf, rnd)
                self.handed += 1
            else:
                pf.close()
        self.stream = RoundStream(self.store, plan, self.spec, epoch=epoch, step_offset=step_offset, start=start,
                                  ahead=take)
        return self.stream

    def read_ahead(self, plan: Round) -> None:
        """Queue the first shards of the round after the current one (its steps from 0) on the current stream."""
        if self.stream is None or self.ahead is not None or not self.stream.owns:
            return
        order = _schedule(plan, self.spec.slots, range(plan.steps))[0]
        pf = self.stream.prefetch
        self.ahead = (order, pf, pf.extend(order))

    def end(self) -> None:
        """Close the current stream; a round that ran to its end hands its prefetcher on to the next one."""
        stream, self.stream = self.stream, None
        if stream is None:
            return
        if stream.ended and self.ahead is not None:
            stream.owns = False
        elif self.ahead is not None:
            self.ahead = None  # the stream's own prefetcher, closed with it
        stream.close()

    def close(self) -> None:
        """Stop every thread, the read-ahead ones too."""
        self.end()
        if self.ahead is not None:
            self.ahead[1].close()
            self.ahead = None
