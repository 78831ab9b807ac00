"""The per-device feature pipeline: padded batches -> truncated forward -> pinned host buffers -> a writer thread."""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from ..errors import ResourceError
from ..runtime.memory import free_memory, is_out_of_memory
from ..storage.codec import SCALED_CODECS
from ..storage import device_codec
from ..targets.runner import TargetRunner, pad_batch
from .plan import pack_batches

__all__ = ["Sample", "Sink", "PipelineStats", "HostBuffers", "FeaturePipeline", "encode_features"]

NUM_BUFFERS = 3  # pinned host buffers a pipeline copies features into (one being filled, one written, one spare)
# A test hook: a forward of more padded tokens than this raises torch.OutOfMemoryError, as a device that holds only
# that many would (the CPU tests' stand-in for a GPU that runs out; never set in use).
FAKE_OOM_ENV = "DFLASH_TEST_OOM_TOKENS"
# Elements of a forward's features encoded on the device at a time: the encoder's float32 temporaries (a few of
# them) stay near 256 MB each, whatever the batch.
ENCODE_ELEMENTS = 1 << 26

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One tokenised sample ready for the target: its source row, token ids and loss mask."""

    row: int
    input_ids: np.ndarray
    loss_mask: np.ndarray


class Sink(Protocol):
    """Takes each sample's features: bf16 [t, L, H]; or, when the pipeline encodes on the device, the store codec's
    codes [t, L, H] with their float32 scales [t, L] (passed only then, as a keyword; ShardWriter.append)."""

    def append(self, input_ids: Any, loss_mask: Any, features: Any, sample_id: int, scales: Any = None) -> None: ...


@dataclass
class PipelineStats:
    """What one run of the pipeline did: samples, real and padded tokens, time spent and time waited on writers."""

    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    seconds: float = 0.0
    wait_s: float = 0.0
    flops: float = 0.0  # the target's model FLOPs over the real tokens (targets/flops.py)

    def add(self, other: "PipelineStats") -> None:
        for f in ("samples", "tokens", "padded_tokens", "batches", "seconds", "wait_s", "flops"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


@dataclass
class _Work:
    batch: list[Sample]
    buf: torch.Tensor | None
    tokens: int
    scales: torch.Tensor | None = None  # the codes' scales [tokens, L] when buf holds a scaled codec's codes
    event: Any = None
    slot: int = -1
    sink: Sink | None = None
    callback: Callable[[], None] | None = None
    shard: int | None = None
    started: Any = None  # the copy's start event, when profiling on CUDA
    forward: tuple[Any, Any] | None = None  # the forward's start and end events, when profiling on CUDA
    shape: tuple[int, int] | None = None  # the forward's padded (rows, length)
    host_s: float = 0.0  # the forward thread's seconds issuing the forward (and, on the CPU, running it)


class _Thread:
    """A daemon thread whose end is waited for on an Event, not with join().

    On Python 3.11 a join() that a signal interrupts (SIGTERM or Ctrl-C raise in the main thread) can mark the
    thread as stopped while it still runs, so the next join() returns at once: the cleanup after a SIGTERM then
    released a shard's claim beside a commit still writing it. An Event's wait has no such state to lose.
    """

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        self._done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                self._done.set()

        threading.Thread(target=run, name=name, daemon=True).start()

    def wait(self) -> None:
        """Return once the thread's function has returned (or raised)."""
        self._done.wait()


class HostBuffers:
    """The pinned host buffers a CUDA pipeline copies features into, allocated on a thread: bf16 [rows, L, H] each
    (or a scaled codec's codes in their first bytes), and beside each a float32 [rows, L] for the codes' scales
    (small: always made, so the buffers do not depend on the store's codec).

    Page-locking them takes about a second a GB (three buffers of a 32K-token batch of an 8B target's 5 layers are
    4 GB): started before the target is loaded, the allocation runs beside the load instead of after it, on the
    path to the first forward. The dtype is explicit, so the target's build (which sets torch's default dtype for
    the process while it runs) cannot change it.
    """

    def __init__(self, shape: tuple[int, int, int], device: Any, num: int = NUM_BUFFERS) -> None:
        self.shape = tuple(int(x) for x in shape)
        self.device = torch.device(device)
        self.num = num
        self._buffers: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dflash-host-buffers", daemon=True)

    def start(self) -> "HostBuffers":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._buffers = [torch.empty(self.shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(self.num)]
            self._scales = [torch.empty(self.shape[:2], dtype=torch.float32, pin_memory=True)
                            for _ in range(self.num)]
        except BaseException as e:  # raised where the pipeline takes the buffers
            self._error = e

    def result(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Return (the feature buffers, the scale buffers) once allocated (handed over: this object keeps none);
        raise what the allocation raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        buffers, scales, self._buffers, self._scales = self._buffers, self._scales, [], []
        return buffers, scales


def encode_features(feats: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (a scaled codec's codes [T, L, H], float32 scales [T, L]) of a forward's features, encoded on their
    device a slice of rows at a time (each (token, layer) row is encoded alone: slices change no byte)."""
    T, L, H = feats.shape
    rows = max(1, ENCODE_ELEMENTS // max(1, L * H))
    if T <= rows:
        return device_codec.encode_on_device(feats, codec)
    codes = torch.empty((T, L, H), dtype=device_codec.stored_torch_dtype(codec), device=feats.device)
    scales = torch.empty((T, L), dtype=torch.float32, device=feats.device)
    for i in range(0, T, rows):
        codes[i : i + rows], scales[i : i + rows] = device_codec.encode_on_device(feats[i : i + rows], codec)
    return codes, scales


class FeaturePipeline:
    """Runs samples through the target and hands each sample's features to a sink, keeping the device busy.

    On CUDA, features are copied into one of a fixed number of pinned host buffers on a side stream, and one
    writer thread waits for each copy, appends the batch's samples to the sink (the store compresses in its own
    pool) and frees the buffer. The forward loop only ever waits when every buffer is still with the writer: that
    wait is the disk's share and is measured. Host memory is bounded by num_buffers * batch_tokens * L * H * 2.

    codec: the store's. Under a scaled codec (fp8, uq) on CUDA the features are encoded on the device before the
    copy (device_codec.encode_on_device, the store's bytes exactly), and the sink gets codes and scales: the
    store's pool threads then only compress, without the GIL, where their numpy quantising took it from the forward
    loop at every torch op (0.62x blosc's tokens a second on an H200). Without a codec, or on the CPU, the sink
    gets bf16 features and the store encodes them.
    """

    # None: encode on the device under a scaled codec on CUDA only; True or False decides (a test turns it on for
    # the CPU, to check the path against the store's own encoding byte for byte).
    encode_on_device: bool | None = None

    def __init__(
        self,
        runner: TargetRunner,
        batch_tokens: int,
        *,
        pad_id: int = 0,
        num_buffers: int = NUM_BUFFERS,
        on_batch: Callable[[int, int], None] | None = None,
        timeline: Any = None,
        profile: bool = False,
        buffers: HostBuffers | None = None,
        floor_tokens: int = 0,
        codec: str | None = None,
    ) -> None:
        self.runner = runner
        # The tokens a forward costs at least (plan.pack_batches): a sharded or offloaded target's weights cross to
        # the device once a forward, so its small batches are packed into larger ones.
        self.floor_tokens = floor_tokens
        # The worker's Timeline (extract/timeline.py): pack, forward and buffer waits per shard on this thread,
        # the copy and the hand-over to the sink on the writer's. profile: also time the device, with CUDA events
        # around each forward and copy that the writer reads once the copy is done: no synchronize, so a
        # profiled run runs as fast as any (a synchronize after each forward cost 10% on an H200).
        self.timeline = timeline
        self.profile = profile
        self._last_end: Any = None  # the previous forward's end event (writer thread): the device's idle gaps
        self.batch_tokens = batch_tokens
        self.pad_id = pad_id
        self.device = runner.device
        self.cuda = self.device.type == "cuda"
        on_device = self.cuda if self.encode_on_device is None else self.encode_on_device
        # The codec the forward loop encodes the features in before the copy, or None (the sink gets bf16).
        self.codec = codec if on_device and codec in SCALED_CODECS else None
        self.on_batch = on_batch
        self._buffers: list[torch.Tensor] = []
        self._scale_buffers: list[torch.Tensor] = []
        if self.cuda:
            # buffers: allocated beside the target's load (HostBuffers) when the caller started them early.
            shape = (batch_tokens, len(runner.layer_ids), runner.hidden_size)
            if buffers is None or buffers.shape != shape:
                buffers = HostBuffers(shape, self.device, num_buffers).start()
            self._buffers, self._scale_buffers = buffers.result()
            num_buffers = len(self._buffers)
            self._copy_stream = torch.cuda.Stream(device=self.device)
        self.num_buffers = num_buffers
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(num_buffers):
            self._free.put(i)
        self._work: queue.Queue[_Work | None] = queue.Queue()
        self._failure: list[BaseException] = []
        self._thread: _Thread | None = None
        # Out of memory: the padded tokens a forward may take from now on (halved at each failure), and the test
        # hook's stand-in for the device's size.
        self._fits: int | None = None
        self._oom_logged = False
        fake = os.environ.get(FAKE_OOM_ENV)
        self._fake_oom = int(fake) if fake else None
        # Callbacks (commits) run on their own thread, one at a time: on the writer's, a commit (the shard's last
        # chunks, its fsyncs) held back the next shard's batches until every host buffer was full and the device
        # stopped, at every shard boundary.
        self._committer: _Thread | None = None
        # Where the writer thread's time goes (seconds): waiting for a batch's device-to-host copy (the device is
        # behind), and handing features to the sink (the sink is behind: copies, compression, disk).
        self.writer_times = {"copy_wait_s": 0.0, "sink_s": 0.0, "callback_wait_s": 0.0}

    def run(self, samples: list[Sample], sink: Sink) -> PipelineStats:
        """Return the stats of running every sample once and waiting until the sink has all of them."""
        stats = self.submit(samples, sink)
        self.drain()
        return stats

    def _stage(self, name: str, shard: int | None) -> Any:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.stage(name, shard)

    def _event(self) -> Any:
        """Return a timing event recorded on the compute stream now (when profiling on CUDA), else None."""
        if not (self.profile and self.cuda and self.timeline is not None):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def submit(self, samples: list[Sample], sink: Sink, shard: int | None = None) -> PipelineStats:
        """Return the forward-side stats after running every sample; the sink may still be receiving them.

        The next shard's forward can start while this one's last batches are written and committed, so the
        device does not idle at shard boundaries.
        """
        stats = PipelineStats()
        flops = getattr(self.runner, "flops", None)
        t0 = time.perf_counter()
        self._raise_failure()
        self._ensure_writer()
        with self._stage("pack", shard):
            lengths = [len(s.input_ids) for s in samples]
            batches = pack_batches(lengths, self.batch_tokens, floor_tokens=self.floor_tokens) if samples else []
        for idx in batches:
            parts = self._forwards([samples[i] for i in idx], shard)
            for batch, ids, lens, feats, scales, start, end, host_s in parts:
                stats.padded_tokens += ids.numel()
                w0 = time.perf_counter()
                slot = self._free.get()
                waited = time.perf_counter() - w0
                stats.wait_s += waited
                if self.timeline is not None:
                    self.timeline.add("wait_buffer", waited, shard)
                if self._failure:
                    self._free.put(slot)
                    break
                with self._stage("forward", shard):  # issuing the copy (asynchronous on CUDA)
                    work = self._to_host(batch, feats, scales, slot, sink, shard)
                    work.forward = (start, end) if start is not None else None
                    work.shape, work.host_s = (int(ids.shape[0]), int(ids.shape[1])), host_s
                    self._work.put(work)
                stats.batches += 1
                stats.samples += len(batch)
                stats.tokens += sum(lens)
                if flops is not None:
                    stats.flops += flops.total(lens)
            if self._failure:
                break
        self._raise_failure()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _forwards(self, batch: list[Sample], shard: int | None) -> Any:
        """Yield (samples, ids, lengths, features, scales, start, end, host seconds) for a batch: one forward, or,
        where the device runs out of memory, forwards of halves of it (down to one row each); a row that does not fit
        alone is a ResourceError. The host seconds of a forward that ran out of memory go to the next one yielded.
        Nothing of a forward that failed reached a sink, so nothing is written twice. Features are bf16 with scales
        None, or the codec's codes and their scales when this pipeline encodes them."""
        pending = [batch]
        lost = 0.0  # seconds of forwards that ran out of memory, not yet in a yielded one's
        while pending:
            part = pending.pop(0)
            with self._stage("pack", shard):
                ids, lens = self._pad(part)
            if len(part) > 1 and self._fits is not None and ids.numel() > self._fits:
                pending[:0] = [part[: len(part) // 2], part[len(part) // 2:]]
                continue
            try:
                h0 = time.perf_counter()
                with self._stage("forward", shard):
                    start = self._event()
                    if self._fake_oom is not None and ids.numel() > self._fake_oom:
                        raise torch.OutOfMemoryError(f"test hook: {ids.numel()} tokens > {FAKE_OOM_ENV}")
                    feats = self.runner.features(ids.to(self.device, non_blocking=True), lens)
                    scales = None
                    if self.codec is not None:  # inside the forward's events and its out-of-memory retry
                        feats, scales = encode_features(feats, self.codec)
                    end = self._event()
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                self._out_of_memory(part, ids, e)
                lost += time.perf_counter() - h0
                pending[:0] = [part[: len(part) // 2], part[len(part) // 2:]]
                continue
            host_s, lost = time.perf_counter() - h0 + lost, 0.0
            yield part, ids, lens, feats, scales, start, end, host_s

    def _out_of_memory(self, part: list[Sample], ids: torch.Tensor, error: BaseException) -> None:
        """Note a forward that ran out of memory: smaller forwards from now on, or a ResourceError for one row."""
        if self.cuda:
            torch.cuda.empty_cache()
        if getattr(self.runner, "in_lockstep", False):  # its peers are inside this forward's collectives
            raise ResourceError(
                f"a forward of {len(part)} rows ({ids.numel():,} padded tokens) of the sharded target ran out of "
                f"memory ({free_memory(self.device)}; {type(error).__name__}); its peers end too. Rerun the same "
                f"command with a smaller --batch-tokens (or --max-length), or over more GPUs (--shard-weights)"
            ) from None
        if len(part) == 1:
            raise ResourceError(
                f"row {part[0].row} of --data ({len(part[0].input_ids):,} tokens) does not fit in memory for the "
                f"target's forward on its own ({free_memory(self.device)}; {type(error).__name__}); rerun with a "
                f"smaller --max-length (longer rows are cut) and --batch-tokens, or leave more memory to activations: "
                f"the weights sharded over more GPUs or held in host memory (--gpus, --shard-weights, --offload cpu)"
            ) from None
        self._fits = ids.numel() // 2
        if not self._oom_logged:
            log.warning("a batch of %d rows (%s padded tokens) ran out of memory (%s); forwards of at most %s "
                        "tokens from now on (--batch-tokens %d asks for more; lower it to skip the retries)",
                        len(part), f"{ids.numel():,}", free_memory(self.device), f"{self._fits:,}",
                        self.batch_tokens)
            self._oom_logged = True

    def then(self, fn: Callable[[], None]) -> None:
        """Run fn in the writer thread once everything submitted so far has reached its sink (e.g. a commit)."""
        self._ensure_writer()
        self._work.put(_Work([], None, 0, callback=fn))

    def drain(self) -> float:
        """Return the seconds waited until the writer finished all submitted work; re-raise its failure."""
        w0 = time.perf_counter()
        if self._thread is not None:
            self._work.put(None)
            self._thread.wait()
            self._thread = None
        self._wait_callback()
        self._raise_failure()
        return time.perf_counter() - w0

    def _ensure_writer(self) -> None:
        if self._thread is None:
            self._thread = _Thread(self._write_loop, "dflash-writer")

    def _wait_callback(self) -> None:
        if self._committer is not None:
            self._committer.wait()
            self._committer = None

    def _start_callback(self, fn: Callable[[], None]) -> None:
        # At most one callback runs: a shard commits while the next one fills, never two commits queue up (a
        # worker dying then loses no more shards than before).
        t0 = time.perf_counter()
        self._wait_callback()
        self.writer_times["callback_wait_s"] += time.perf_counter() - t0
        if self._failure:
            return

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # handed to the forward loop, which re-raises it in its own thread
                self._failure.append(e)

        self._committer = _Thread(run, "dflash-commit")

    def _raise_failure(self) -> None:
        if self._failure:
            err = self._failure[0]
            self._failure.clear()
            raise err

    def _pad(self, batch: list[Sample]) -> tuple[torch.Tensor, list[int]]:
        ids, lens = pad_batch([s.input_ids for s in batch], self.pad_id)
        # Pinned, so the host-to-device copy of the ids is asynchronous.
        return (ids.pin_memory() if self.cuda else ids), lens

    def _to_host(self, batch: list[Sample], feats: torch.Tensor, scales: torch.Tensor | None, slot: int, sink: Sink,
                 shard: int | None) -> _Work:
        T = feats.shape[0]
        if not self.cuda:
            return _Work(batch, feats, T, scales=scales, slot=slot, sink=sink, shard=shard)
        buf = self._buffers[slot]
        scale_buf = None
        if scales is not None:
            # The codes take the bf16 buffer's first bytes (fp8's half of them), as [T, L, H] of their own dtype.
            flat = buf.view(-1).view(feats.dtype)
            buf = flat[: feats.numel()].view(feats.shape)
            scale_buf = self._scale_buffers[slot][:T]
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        started = None
        with torch.cuda.stream(self._copy_stream):
            if self.profile and self.timeline is not None:
                started = torch.cuda.Event(enable_timing=True)
                started.record(self._copy_stream)
            buf[:T].copy_(feats, non_blocking=True)
            if scales is not None:
                scale_buf.copy_(scales, non_blocking=True)
            event = torch.cuda.Event(enable_timing=started is not None)
            event.record(self._copy_stream)
        # The caching allocator must not hand feats' memory to the next forward before the copy has read it.
        feats.record_stream(self._copy_stream)
        if scales is not None:
            scales.record_stream(self._copy_stream)
        return _Work(batch, buf, T, scales=scale_buf, event=event, slot=slot, sink=sink, shard=shard,
                     started=started)

    def _write_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            try:
                if self._failure:
                    continue  # after a failure the rest is dropped; the forward loop re-raises it
                if item.callback is not None:
                    self._start_callback(item.callback)
                    continue
                t0 = time.perf_counter()
                if item.event is not None:
                    item.event.synchronize()
                t1 = time.perf_counter()
                off = 0
                for s in item.batch:
                    n = len(s.input_ids)
                    if item.scales is None:
                        item.sink.append(s.input_ids, s.loss_mask, item.buf[off : off + n], s.row)
                    else:
                        item.sink.append(s.input_ids, s.loss_mask, item.buf[off : off + n], s.row,
                                         scales=item.scales[off : off + n])
                    off += n
                t2 = time.perf_counter()
                self.writer_times["copy_wait_s"] += t1 - t0
                self.writer_times["sink_s"] += t2 - t1
                if self.timeline is not None:
                    times = {"copy": t1 - t0, "sink": t2 - t1}
                    if item.started is not None:
                        times["copy_device"] = item.started.elapsed_time(item.event) / 1000.0
                    if item.forward is not None:  # done: the copy waited for it
                        start, end = item.forward
                        times["forward_device"] = start.elapsed_time(end) / 1000.0
                        if self._last_end is not None:  # the device between two forwards: waiting for the host
                            times["device_idle"] = max(0.0, self._last_end.elapsed_time(start) / 1000.0)
                        self._last_end = end
                    self.timeline.add_many(item.shard, times)
                    if self.profile and item.shape is not None:  # the rows are --profile's alone
                        self.timeline.add_batch(
                            shard=item.shard, rows=item.shape[0], length=item.shape[1], tokens=item.tokens,
                            host_forward_s=item.host_s, **{f"{k}_s": v for k, v in times.items()})
                if self.on_batch is not None:
                    self.on_batch(len(item.batch), item.tokens)
            except BaseException as e:  # handed to the forward loop, which re-raises it in its own thread
                self._failure.append(e)
            finally:
                if item.slot >= 0:
                    self._free.put(item.slot)
