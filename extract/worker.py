"""One extract worker (one process per device): claims uncommitted shards one at a time and fills them."""
from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ClaimLost, InputError, StoreError
from ..conversations import BadRowLog, Row
from .placement import batch_floor, is_sharded
from .plan import claim_order

if TYPE_CHECKING:
    from ..config import ExtractConfig

__all__ = ["WorkerSpec", "auto_writer_threads", "prepare_shard", "open_encoder", "open_pipeline",
           "host_buffers", "run_worker", "fill_shards"]

log = logging.getLogger(__name__)

Report = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs besides the config: its device, its number, and the header the store must have."""

    device: str
    index: int
    header: dict[str, Any]
    writer_threads: int | None = None  # None: the store's default


def auto_writer_threads(workers: int, cpus: int | None = None) -> int:
    """Return the compression threads each of `workers` local workers gets: the CPUs shared out (one left for
    each worker's own forward and writer threads), 2 to 16 each.

    Blosc(zstd-1) compresses bf16 features at well under 1 GB/s a core, while one H200 extracting an 8B target
    makes ~1.2 GB/s of them: four threads a worker (the old fixed default) held the device back.
    """
    cpus = cpus or os.cpu_count() or 2
    return max(2, min(16, cpus // max(1, workers) - 1))


TRUNCATED = "truncated_at_max_length"


def prepare_shard(rows: list[Row], encoder: Any, min_loss_tokens: int, strict: bool,
                  altered: BadRowLog | None = None) -> tuple[list[Any], BadRowLog]:
    """Return the shard's trainable samples and the log of its dropped rows (bad rows and too few loss tokens);
    kept rows that were changed on the way (invalid UTF-8 replaced, cut at max length) go into `altered`."""
    from .pipeline import Sample
    from .template import TemplateError

    samples: list[Sample] = []
    dropped = BadRowLog()
    for row in rows:
        reason, detail = row.error, row.detail
        if reason is None:
            try:
                enc = encoder.encode(row.messages)
            except TemplateError as e:
                reason, detail = "template_error", str(e)
            else:
                n = enc.num_loss_tokens
                if n == 0:
                    reason, detail = "no_loss_tokens", "no assistant token left after truncation"
                elif n < min_loss_tokens:
                    # Not a bad row, a filter: recorded the same way so a resumed run never redoes it.
                    dropped.add("too_few_loss_tokens", row.index)
                    continue
                else:
                    samples.append(Sample(row.index, enc.input_ids, enc.loss_mask))
                    if altered is not None:
                        for note in row.notes:
                            altered.add(note, row.index)
                        if enc.cut_tokens:
                            altered.add(TRUNCATED, row.index)
                    continue
        if strict:
            raise InputError(f"{row.where}: bad row ({reason}: {detail}); fix or remove it, or rerun without --strict")
        dropped.add(reason, row.index)
    return samples, dropped


def _commit(writer: Any, shard_id: int, extra: dict, open_writers: dict, done: list, report: Report, index: int) -> None:
    try:
        record = writer.commit(extra)
    except ClaimLost as e:
        # A peer took the shard over while this process stalled past its claim's lease: the peer commits it.
        open_writers.pop(shard_id, None)
        log.warning("%s", e)
        return
    open_writers.pop(shard_id, None)
    done.append(shard_id)
    report({"kind": "shard", "worker": index, "shard": shard_id, "bytes": record.get("bytes", 0)})


def _kernels(pipeline: Any) -> dict[str, Any]:
    """Return the commit record's note of the kernels the shard's target ran (targets/kernels.py)."""
    kernels = getattr(getattr(pipeline, "runner", None), "kernels", None)
    return {"kernels": kernels.to_dict()} if kernels is not None else {}


def _disk_full(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    return False


def open_encoder(cfg: "ExtractConfig") -> tuple[Any, int]:
    """Return (the chat encoder a worker tokenises with, the tokenizer's pad id)."""
    from transformers import AutoTokenizer

    from .template import ChatEncoder, load_template

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    encoder = ChatEncoder(tokenizer, load_template(tokenizer, cfg.chat_template), cfg.max_length,
                          cfg.chat_template_kwargs)
    return encoder, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def host_buffers(cfg: "ExtractConfig", header: dict[str, Any], device: str) -> Any:
    """Return the pipeline's pinned host buffers being allocated on a thread (pipeline.HostBuffers), or None off
    CUDA (no copies there)."""
    from .pipeline import HostBuffers

    if not device.startswith("cuda"):
        return None
    shape = (cfg.batch_tokens, len(header["layer_ids"]), int(header["hidden_size"]))
    return HostBuffers(shape, device).start()


# --compile-layers auto compiles the decoder layers on a GPU for a run with this many tokens left at least: compiling
# took ~15 s of a Qwen3-30B-A3B-shaped worker on one H100 and sped its forward up 1.62x (bench/RESULTS.md, 2026-12-05),
# so a run of minutes of forward gains; the GPU demo's 2.7M tokens (a minute) stay eager.
COMPILE_MIN_TOKENS = 10_000_000


def compile_layers(cfg: "ExtractConfig", device: Any, tokens_left: int) -> str:
    """Return whether a resident target's decoder layers are compiled, as TargetRunner takes it: "on", "off", or
    "auto" (compiled unless it has Gated DeltaNet layers) on a GPU for a run of COMPILE_MIN_TOKENS tokens left or
    more."""
    import torch

    choice = getattr(cfg, "compile_layers", "auto")
    if choice != "auto":
        return choice
    if torch.device(device).type != "cuda":
        return "off"
    if tokens_left < COMPILE_MIN_TOKENS:
        log.info("decoder layers run eager: this run's ~%s tokens left are under --compile-layers auto's %s "
                 "(--compile-layers on compiles them anyway)", f"{tokens_left:,}", f"{COMPILE_MIN_TOKENS:,}")
        return "off"
    return "auto"


def feature_runner(cfg: "ExtractConfig", header: dict[str, Any], model: Any, tokens_left: int = 0) -> Any:
    """Return the truncated runner of a loaded target, checked against the full model (InputError when it differs)
    on rows as long as the longest sample extraction runs, or longer than every attention window; its decoder layers
    compiled as --compile-layers says for a run of tokens_left tokens, on CUDA first called on a batch of the run's
    size (kernels.warm_forward: Triton tunes each kernel at its first launch; the CPU's kernels are not tuned, and
    a long row's attention there costs seconds)."""
    from ..targets.runner import TargetRunner

    device = next(model.parameters()).device
    warm = (cfg.batch_tokens or 0) if device.type == "cuda" else 0
    return TargetRunner(model, header["layer_ids"], check_length=cfg.max_length,
                        compile_layers=compile_layers(cfg, device, tokens_left), warm_tokens=warm)


def sharded_runner(cfg: "ExtractConfig", header: dict[str, Any], device: Any) -> Any:
    """Return the lockstep runner of the target sharded as cfg says (--shard-weights, --offload), loaded (each rank
    reading its part of each tensor) and checked against its own full forward on every rank; on a world of one (one
    GPU streaming its weights from host memory) the runner itself."""
    from ..config.options import parse_shard_weights
    from ..targets.sharded import ShardedRunner, init_group, load_sharded
    from .lockstep import Lockstep, collective

    import torch.distributed as dist

    init_group(device, cfg.collective_timeout)
    if getattr(cfg, "compile_layers", "auto") == "on":
        log.warning("--compile-layers on: a target sharded or offloaded (--shard-weights, --offload) runs its layers "
                    "eager; compiling them is not supported yet")
    shard = parse_shard_weights(cfg.shard_weights) or 1
    if dist.get_world_size() == 1:
        # no peers: no collective to time out (a large target's host load may take longer) and no lockstep, so an
        # out-of-memory batch is retried in halves as on a resident target
        model = load_sharded(cfg.model, device, cfg.dtype, shard, cfg.offload == "cpu")
        return ShardedRunner(model, header["layer_ids"], device, check_length=cfg.max_length)
    with collective("loading the sharded target", cfg.collective_timeout):
        model = load_sharded(cfg.model, device, cfg.dtype, shard, cfg.offload == "cpu")
        runner = ShardedRunner(model, header["layer_ids"], device, check_length=cfg.max_length)
    return Lockstep(runner, cfg.collective_timeout)


def feature_pipeline(cfg: "ExtractConfig", header: dict[str, Any], device: str, pad_id: int,
                     on_batch: Callable[[int, int], None] | None = None, timeline: Any = None,
                     runner: Any = None, buffers: Any = None, codec: str | None = None,
                     tokens_left: int = 0) -> Any:
    """Return the feature pipeline of the target on `device` (loaded and checked now unless `runner` is the
    target's runner already made; buffers: its host buffers already being allocated, else they are allocated
    beside this load; codec: the store's, which a CUDA pipeline encodes fp8 and uq features in before their copy
    to the host, or None to hand the sink bf16 features)."""
    import contextlib

    import torch

    from ..targets.load import load_for_features
    from .pipeline import FeaturePipeline

    def stage(name: str) -> Any:
        return timeline.stage(name) if timeline is not None else contextlib.nullcontext()

    dev = torch.device(device)
    with stage("device_init"):
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            torch.cuda.init()
    profile = bool(getattr(cfg, "profile", None))
    if buffers is None:
        buffers = host_buffers(cfg, header, device)
    if runner is None and is_sharded(cfg):
        with stage("model_load"):  # the load, the self-check and its collectives
            runner = sharded_runner(cfg, header, dev)
    if runner is None:
        with stage("model_load"):
            model = load_for_features(cfg.model, dev, getattr(torch, cfg.dtype))
        with stage("runner"):  # the truncated runner and its self-check against the full model
            runner = feature_runner(cfg, header, model, tokens_left)
    with stage("host_buffers"):  # waiting for the pinned host buffers features are copied into
        return FeaturePipeline(runner, cfg.batch_tokens, pad_id=pad_id, on_batch=on_batch, timeline=timeline,
                               profile=profile, buffers=buffers, floor_tokens=batch_floor(cfg), codec=codec)


def open_pipeline(cfg: "ExtractConfig", header: dict[str, Any], device: str,
                  on_batch: Callable[[int, int], None] | None = None) -> tuple[Any, Any]:
    """Return (the chat encoder, the feature pipeline of the target on `device`) that a worker extracts with."""
    encoder, pad_id = open_encoder(cfg)
    return encoder, feature_pipeline(cfg, header, device, pad_id, on_batch)


def run_worker(cfg: "ExtractConfig", spec: WorkerSpec, plan: Any, report: Report, *,
               timeline: Any = None, encoder: tuple[Any, int] | None = None,
               runner: Any = None, runner_s: float = 0.0, buffers: Any = None) -> dict[str, Any]:
    """Return this worker's totals (and its timeline) after it has filled every shard of the plan (the parent's
    plan.ExtractionPlan: rows and shard ranges) it could claim; report() gets progress events.

    timeline: the run's Timeline when the worker runs in the command's own process (else one from this process's
    start); encoder: (chat encoder, pad id) already made; runner: the target's runner already made and checked
    (orchestrate loads the target beside reading the data and checks it before the store exists), runner_s: the
    seconds the command waited for it (counted in the load time the summary reports); buffers: the
    pipeline's host buffers already being allocated (worker.host_buffers).
    """
    from ..storage import Store
    from .timeline import Timeline

    tl = timeline if timeline is not None else Timeline()
    t_start = time.perf_counter()
    header = spec.header
    with tl.stage("store"):
        store = Store.open(cfg.out, expected=header)
    if encoder is None:
        with tl.stage("tokenizer"):
            encoder = open_encoder(cfg)
    encoder, pad_id = encoder
    loaded: dict[str, float] = {}
    marks: dict[str, Any] = {}
    made: list[Any] = []

    def make_pipeline() -> Any:
        # Called once the first shard is being tokenised: loading the model and tokenising overlap.
        pipeline = feature_pipeline(
            cfg, header, spec.device, pad_id,
            on_batch=lambda n, t: report({"kind": "batch", "worker": spec.index, "samples": n, "tokens": t}),
            timeline=tl, runner=runner, buffers=buffers, codec=store.header["codec"], tokens_left=plan.tokens_left)
        loaded["load_s"] = runner_s + time.perf_counter() - t_start
        from .perf import memory_mark

        marks["memory"] = memory_mark(spec.device)  # the run's memory from here: its start-up is behind it
        made.append(pipeline)
        return pipeline

    def samples_for(shard_id: int) -> tuple[list[Any], dict[str, Any]]:
        with tl.stage("tokenise", shard_id, main=False):
            start, stop, rows = plan.shard_rows(shard_id)
            altered = BadRowLog()
            samples, dropped = prepare_shard(rows, encoder, cfg.min_loss_tokens, cfg.strict, altered)
        report({"kind": "dropped", "worker": spec.index, "samples": stop - start - len(samples)})
        return samples, {"rows": [start, stop], "dropped": dropped.to_dict(), "altered": altered.to_dict()}

    pipeline: Any = make_pipeline
    if is_sharded(cfg):
        pipeline = _lockstep_pipeline(cfg, spec.device, store, make_pipeline)
    try:
        result = fill_shards(store, samples_for, pipeline, report, spec,
                             writer_threads=cfg.writer_threads or spec.writer_threads, timeline=tl)
        lockstep = getattr(pipeline, "runner", None)  # extract.lockstep.Lockstep when sharded and loaded
        if hasattr(lockstep, "finish"):  # step with the peers until none has rows left
            with tl.stage("lockstep"):
                result["empty_forwards"] = lockstep.finish()
    except BaseException as e:
        if _disk_full(e):
            raise StoreError(
                f"{cfg.out}: disk full (ENOSPC) while writing shards; every committed shard is intact. "
                "Free space (or move --out) and rerun the same command to resume"
            ) from None
        raise
    result = {**result, "load_s": round(loaded["load_s"], 3) if loaded else None}
    perf = {}
    if made:
        from .perf import device_memory, device_peak, worker_perf

        device_s = sum(row.get("forward_device", 0.0) for row in tl.shards.values())
        perf = worker_perf(made[0].runner, *device_peak(spec.device), result.get("flops", 0.0),
                           result.get("tokens", 0), result.get("steady_s") or 0.0, device_s,
                           memory=device_memory(spec.device, marks.get("memory")))
    return {**result, "perf": perf,
            "timeline": tl.to_dict(device=spec.device, pid=os.getpid(), index=spec.index, perf=perf)}


def _lockstep_pipeline(cfg: "ExtractConfig", device: str, store: Any, make_pipeline: Callable[[], Any]) -> Any:
    """Return the pipeline of a sharded target made now (every rank holds a part of the weights its peers need, so
    each loads it whether or not it gets a shard), or make_pipeline itself when no rank has a shard left to do."""
    from ..targets.sharded import init_group
    from .lockstep import agree_any, collective

    import torch

    init_group(torch.device(device), cfg.collective_timeout)
    with collective("agreeing on the work left", cfg.collective_timeout):
        left = agree_any(len(store.committed_ids()) < store.num_shards)
    return make_pipeline() if left else make_pipeline


def fill_shards(store: Any, samples_for: Callable, pipeline: Any, report: Report, spec: WorkerSpec, *,
                writer_threads: int | None = None, timeline: Any = None) -> dict[str, Any]:
    """Return this worker's totals after claiming and committing every shard it could get, one claim at a time.

    samples_for(shard_id) gives the shard's samples and the commit extra (rows, drops); pipeline is the
    FeaturePipeline, or a function that makes it (called once the first shard is claimed and tokenising, so that
    a model load overlaps it; not at all when there is nothing left to do). A shard is committed by
    the pipeline's writer thread after its last sample, while the device already runs the next shard and a thread
    tokenises the one after, so at most three shards are claimed per worker (one tokenising, one running, one
    committing); a failure aborts them (their claims are released, the data is garbage).
    """
    from concurrent.futures import ThreadPoolExecutor

    from .pipeline import PipelineStats
    from .timeline import Timeline

    tl = timeline if timeline is not None else Timeline()
    totals = PipelineStats()
    open_writers: dict[int, Any] = {}
    done: list[int] = []
    times: dict[str, float] = {}
    t0 = time.perf_counter()

    def claim(shard_id: int) -> Any:
        writer = store.try_claim(shard_id, threads=writer_threads)
        if writer is not None:
            open_writers[shard_id] = writer
        return writer

    def claims() -> Any:
        for shard_id in claim_order(store.num_shards, store.committed_ids(), spec.index):
            if (writer := claim(shard_id)) is not None:
                yield shard_id, writer
        # A peer killed while we ran still "holds" its claims, and nobody would redo them until the next run:
        # before leaving, look again at every uncommitted shard and take over the claims of dead processes
        # (try_claim does), until a pass takes none. Claims of live peers stay theirs: they commit those.
        took = True
        while took:
            took = False
            committed = set(store.committed_ids())
            for shard_id in range(store.num_shards):
                if shard_id not in committed and shard_id not in open_writers:
                    if (writer := claim(shard_id)) is not None:
                        took = True
                        yield shard_id, writer

    def commit(writer: Any, shard_id: int, extra: dict) -> None:
        with tl.stage("commit", shard_id, main=False):
            _commit(writer, shard_id, extra, open_writers, done, report, spec.index)
        tl.add_many(shard_id, writer.times)
        times.setdefault("first_commit", time.perf_counter())
        times["last_commit"] = time.perf_counter()

    # The next shard is claimed and tokenised on a thread while the device runs this one: tokenising is not on
    # the device's critical path (it was, shard after shard).
    tokenizer = ThreadPoolExecutor(1, thread_name_prefix="dflash-tokenize")

    def next_claim(queue: Any) -> Any:
        c0 = time.perf_counter()
        nxt = next(queue, None)
        tl.add("claim", time.perf_counter() - c0, nxt[0] if nxt else None)
        return nxt

    try:
        queue = claims()
        nxt = next_claim(queue)
        ready = tokenizer.submit(samples_for, nxt[0]) if nxt else None
        if nxt is not None and not hasattr(pipeline, "submit"):
            pipeline = pipeline()
            t0 = time.perf_counter()  # the first commit is timed from a loaded model
        while nxt is not None:
            shard_id, writer = nxt
            with tl.stage("wait_tokenise", shard_id):
                samples, extra = ready.result()
            nxt = next_claim(queue)
            ready = tokenizer.submit(samples_for, nxt[0]) if nxt else None
            times.setdefault("first_forward", time.perf_counter())
            stats = pipeline.submit(samples, writer, shard_id)
            totals.add(stats)
            extra = {**extra, "device": spec.device, **stats.to_dict(), **_kernels(pipeline)}
            pipeline.then(lambda w=writer, sid=shard_id, x=extra: commit(w, sid, x))
        if hasattr(pipeline, "drain"):
            with tl.stage("drain"):
                totals.wait_s += pipeline.drain()
    except BaseException:
        try:
            if hasattr(pipeline, "drain"):
                pipeline.drain()
        except BaseException:
            pass  # the first failure is the one to report
        for w in list(open_writers.values()):
            w.abort()
        store.release_own_claims()
        raise
    finally:
        tokenizer.shutdown(wait=True, cancel_futures=True)
    totals.seconds = time.perf_counter() - t0
    # Steady state: from the first forward to the last commit, every byte on disk (the run minus its start-up).
    steady = times["last_commit"] - times["first_forward"] if "last_commit" in times else 0.0
    return {"device": spec.device, "shards": len(done), "pid": os.getpid(), **totals.to_dict(),
            **{f"writer_{k}": round(v, 3) for k, v in getattr(pipeline, "writer_times", {}).items()},
            "first_commit_s": round(times["first_commit"] - t0, 3) if "first_commit" in times else None,
            "steady_s": round(steady, 3)}
