"""Orchestration of `dflash extract`: header and store, one worker per device, progress, completion, summary."""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from ..config import resolve_devices
from ..runtime.process import launch, ranks_from_env
from ..errors import InputError, StoreError, StoreUnavailable
from ..conversations import BadRowLog, read_rows, report_bad_rows

if TYPE_CHECKING:
    from ..config import ExtractConfig

__all__ = ["run"]

log = logging.getLogger(__name__)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {n:,}" for reason, n in sorted(counts.items()))


def _require_usable(bad: BadRowLog, total: int, data: tuple[str, ...]) -> None:
    """Raise InputError naming the drop counts by reason if no row of the data can become a sample."""
    if bad.total() < total:
        return
    raise InputError(
        f"--data {' '.join(data)}: none of its {total:,} rows is usable ({bad.summary()}); expected rows with "
        "messages, conversations, instruction+output or prompt plus an assistant turn; fix the data (the warnings "
        "above show the first bad rows)"
    )


def _stored(url: str) -> tuple[dict[str, Any] | None, bool]:
    """Return (the header of the store at url, whether every shard of it is committed); (None, False) if there is
    none (yet) or it cannot be read."""
    from ..storage import Store

    try:
        store = Store.open(url)
    except StoreUnavailable:
        raise  # unreachable is not "no store yet": say so before the model loads
    except StoreError:
        return None, False
    return store.header, store.is_complete()


def _resolve_dtype(cfg: "ExtractConfig", device: str, stored: dict[str, Any] | None) -> "ExtractConfig":
    """Return cfg with --dtype made concrete (targets/numerics.py, logging why), as the header records it.

    A store being resumed keeps the dtype it was extracted in when --dtype is auto, even where auto would now pick
    another: its shards must all come from one numerics, and another dtype would refuse the header anyway.
    """
    import dataclasses

    from ..config import DTYPES
    from ..targets.numerics import resolve_dtype

    recorded = (stored or {}).get("compute_dtype")
    dtype = resolve_dtype(cfg.dtype, device, auto=recorded if recorded in DTYPES else None,
                          auto_reason=f"the store being resumed ({cfg.out}) was extracted in it")
    return dataclasses.replace(cfg, dtype=dtype)


def _resolve_codec(cfg: "ExtractConfig", stored: dict[str, Any] | None) -> "ExtractConfig":
    """Return cfg with --codec made concrete: auto is the store's own codec when it is resumed (one made before uq6
    became the default, 2026-12-05, resumes in blosc), else the default (storage.codec.resolve_codec)."""
    import dataclasses

    from ..storage.codec import resolve_codec

    codec = resolve_codec(cfg.codec, (stored or {}).get("codec"))
    if cfg.codec == "auto" and stored and stored.get("codec") == codec:
        log.info("codec %s: the store being resumed (%s) was extracted in it", codec, cfg.out)
    return dataclasses.replace(cfg, codec=codec)


def _worker_main(cfg_dict: dict[str, Any], spec: Any, plan: Any, report: Any) -> dict[str, Any]:
    """Entry point of a spawned worker process: one device's share of the plan's shards."""
    from ..config import ExtractConfig
    from .worker import run_worker

    return run_worker(ExtractConfig.from_dict(cfg_dict), spec, plan, report)


def _run_spawned(cfg: "ExtractConfig", specs: list[Any], plan: Any, progress: Any) -> list[dict[str, Any]]:
    """Return the results of one worker process per device, each handed the plan in its arguments (its rows are
    the data's index, a few MB: plan.ExtractionPlan says why), folding their events into progress as they come.

    A failed worker leaves the others to finish (and commit) their shards; a rerun redoes the rest.
    """
    from .placement import is_sharded

    # Workers sharing a sharded target are one process group, in lockstep: one that fails ends the others.
    sharded = is_sharded(cfg)
    return launch(_worker_main, [(cfg.to_dict(), spec, plan) for spec in specs], what="extract worker",
                  on_event=progress.update, stop_all_on_error=sharded, dist_env=sharded)


def _plan(cfg: "ExtractConfig", header: dict[str, Any], rows: Any, scan: Any, devices: list[str]) -> Any:
    """Return the run's plan.ExtractionPlan: its shards against those an existing store of this header has
    committed."""
    from ..storage import Store
    from .plan import make_plan

    try:
        committed = Store.open(cfg.out, expected=header).committed_ids()
    except StoreUnavailable:
        raise
    except StoreError:  # no store yet, or another header's (opening it for writing reports it, or replaces a
        committed = []  # skeleton): its shards are not this run's
    return make_plan(header, rows, scan, committed, cfg.out, devices)


def _dry_run(cfg: "ExtractConfig", header: dict[str, Any], plan: Any, tokenizer: Any, template: str,
             placement: Any, devices: int) -> dict[str, Any]:
    """Print the plan measured (extract/dry_run.py) and return it as `dflash extract --dry-run`'s result.

    Sharded over the devices of this one process (no launcher: they would be spawned), the measurement runs on one
    device with the weights streamed from host memory, and says so; under torchrun every rank measures sharded.
    """
    from .dry_run import format_plan, measure
    from .template import ChatEncoder

    note = ""
    if placement.sharded and devices > 1:
        cfg = dataclasses.replace(cfg, shard_weights="1", offload="cpu")
        note = " (measured on one device, weights streamed from host memory)"
    encoder = ChatEncoder(tokenizer, template, cfg.max_length, cfg.chat_template_kwargs)
    dry = measure(cfg, header, plan, encoder)
    click.echo(format_plan(dry, cfg.out, cfg.codec) + f"\n  {placement.line()}{note}")
    return {"plan": {**dry.to_dict(), "placement": {"shard": placement.shard, "offload": placement.offload,
                                                    "batch_tokens": placement.batch_tokens,
                                                    "reason": placement.reason}}}


def _timed_imports(tl: Any) -> None:
    """Import what the command needs, timed by what each part brings in (the timeline's import_* parts).

    Each part counts only what is not imported yet (transformers comes after torch, which it imports), and what
    the command line imported before run() shows in the timeline's `python` part: the parts are what this
    process really spends, in its order.
    """
    with tl.stage("import_torch"):
        import torch  # noqa: F401
    with tl.stage("import_transformers"):
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401
    with tl.stage("import_storage"):
        from numcodecs import blosc  # noqa: F401  (the store's compressor; its threads would import it later)

        from .. import storage  # noqa: F401
    with tl.stage("import_dflash"):
        from ..targets import adapter, load, runner  # noqa: F401
        from . import header, loader, progress, template, worker  # noqa: F401


def _model_files(model: str) -> tuple[Any, Any]:
    """Return (the model's config, its tokenizer); InputError if the folder has not both."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        return AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise InputError(
            f"--model {model}: expected a Hugging Face model folder with config.json and a tokenizer; "
            f"{str(e).splitlines()[0][:200]}"
        ) from None


def _load_beside(cfg: "ExtractConfig", devices: list[str], complete: bool) -> bool:
    """Return True if this process loads its target on a thread beside the rest of start-up.

    One device in this process: its target is checked and loaded from the moment device and dtype are known,
    beside reading the data, the header, the plan, the store and the first shard's tokenising (extract/loader.py
    says why that is safe). A dry run measures with its own load; a complete store needs no model. Several
    devices keep the in-line load in each spawned worker: there it could only hide the worker's tokenizer load
    (a second or so; header, plan and store were made by this process before it spawned),
    and all workers loading at once share the disk, so the load is the critical path either way.
    """
    from .placement import is_sharded

    return len(devices) == 1 and not cfg.dry_run and not complete and not is_sharded(cfg)


def _placement(cfg: "ExtractConfig", model_config: Any, devices: list[str], depth: int | None) -> Any:
    """Return the run's placement.Placement (where the weights live, the batch size), logged on rank 0.

    auto needs the target's size (counted on the meta device), the GPUs' free memory (the least of the run's: every
    rank agrees) and the host's; each is read only where the decision needs it. Weights streamed from host memory
    also measure the host-to-GPU copy's speed (the slowest rank's), which sizes their batch.
    """
    import torch

    from ..config.options import parse_shard_weights
    from ..runtime.memory import host_available_bytes
    from ..targets.sharded import captured_size
    from .placement import placement_of, target_size

    ranks = ranks_from_env()
    launched = ranks.world > 1
    world = ranks.world if launched else len(devices)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or (len(devices) if not launched else 1)
    on_gpu = devices[0].startswith("cuda")
    auto = parse_shard_weights(cfg.shard_weights) is None
    size = free = None
    if depth is not None and (on_gpu or not auto):
        captured = len(cfg.layers) if cfg.layers else 5
        size = target_size(captured_size(model_config, depth, cfg.dtype), captured)
    if on_gpu and (auto or cfg.offload == "cpu"):
        free = _least(min(torch.cuda.mem_get_info(torch.device(d))[0] for d in devices), launched, cfg, devices[0])
    host_free = host_available_bytes()
    if on_gpu and host_free is not None:  # nodes differ: the least decides, as for the GPUs' free memory
        host_free = _least(host_free, launched, cfg, devices[0])
    placement = placement_of(cfg, size, free=free, host_free=host_free, local_world=local_world, world=world,
                             on_gpu=on_gpu)
    if on_gpu and placement.offload and cfg.batch_tokens is None and size is not None:
        # streamed weights: the batch is sized from the host link this machine measures (extract/placement.py)
        from ..targets.streamed import host_link_bytes_per_s
        from .perf import device_peak

        link = _least(host_link_bytes_per_s(torch.device(devices[0])) or 0.0, launched, cfg, devices[0])
        peak = _least(device_peak(devices[0])[1] or 0.0, launched, cfg, devices[0])  # an unknown GPU: none
        placement = placement_of(cfg, size, free=free, host_free=host_free, local_world=local_world, world=world,
                                 on_gpu=on_gpu, link=link or None, device_flops=peak or None)
    if ranks.rank == 0:
        log.info("%s", placement.line())
    return placement


def _least(value: float, launched: bool, cfg: "ExtractConfig", device: str) -> Any:
    """Return the least of `value` over the run's ranks (itself when not launched): every rank must take the same
    placement, so the GPU with the least free memory or the slowest host link decides."""
    if not launched:
        return value
    import torch
    import torch.distributed as dist

    from ..targets.sharded import init_group

    init_group(torch.device(device), cfg.collective_timeout)
    least = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return type(value)(least.item())


def run(cfg: "ExtractConfig") -> dict[str, Any]:
    """Return the run summary after extracting every uncommitted shard of cfg.out (rerun the same config to resume)."""
    from .timeline import Timeline

    from ..storage.claims import lease_seconds

    lease_seconds()  # a bad DFLASH_CLAIM_LEASE_S is refused before the target loads, not at the first claim
    tl = Timeline()  # from this process's start: the parts of a one-device run add up to the command's wall time
    prefetch = _prefetch(cfg, tl)
    try:
        return _run(cfg, tl)
    finally:
        prefetch.close()
        if "torch" in sys.modules:  # a sharded target's process group (targets/sharded.py), if one was joined
            from ..targets.sharded import release_group

            release_group()


def _prefetch(cfg: "ExtractConfig", tl: Any) -> Any:
    """Start reading the target's weight files into the page cache, beside the imports (target.load.WeightPrefetch)."""
    from ..targets.load import WeightPrefetch

    prefetch = WeightPrefetch(cfg.model, on_done=lambda s: tl.add("model_prefetch", s, main=False))
    return prefetch.start()


def _run(cfg: "ExtractConfig", tl: Any) -> dict[str, Any]:
    """Return run()'s summary (its timeline started, the weights being read)."""
    _timed_imports(tl)
    from ..targets.adapter import check_architecture
    from .header import captured_depth
    from .loader import BackgroundLoad

    with tl.stage("model_config"):
        model_config, tokenizer = _model_files(cfg.model)
    ranks = ranks_from_env()
    local_rank = ranks.local_rank if ranks.world > 1 else None
    with tl.stage("devices"):
        devices = resolve_devices(cfg.gpus, local_rank)
        stored, complete = _stored(cfg.out)
        cfg = _resolve_codec(_resolve_dtype(cfg, devices[0], stored), stored)
    depth = captured_depth(cfg.layers, model_config)
    with tl.stage("model_config"):
        placement = _placement(cfg, model_config, devices, depth)
    cfg = dataclasses.replace(cfg, shard_weights=str(placement.shard), offload="cpu" if placement.offload else "none",
                              batch_tokens=placement.batch_tokens)
    loader = None
    if _load_beside(cfg, devices, complete):
        loader = BackgroundLoad(cfg.model, model_config, devices[0], cfg.dtype, tl, depth).start()
    else:
        with tl.stage("model_config"):
            check_architecture(model_config, cfg.model, depth)
    try:
        summary = _extract(cfg, tl, model_config, tokenizer, devices, stored, ranks.rank, local_rank, loader,
                           placement)
    except Exception:
        if loader is not None:
            loader.close(wait=True)  # a refusal: no model keeps loading once run() has returned
        raise
    except BaseException:
        if loader is not None:
            loader.close(wait=False)  # Ctrl-C, SIGTERM: stop now, the process ends around the load
        raise
    if loader is not None:
        loader.close(wait=True)  # a load nobody waited for (every shard claimed by peers) ends here, dropped
    return summary


def _extract(cfg: "ExtractConfig", tl: Any, model_config: Any, tokenizer: Any, devices: list[str],
             stored: dict[str, Any] | None, rank: int, local_rank: int | None, loader: Any,
             placement: Any) -> dict[str, Any]:
    """Return the run summary (run()'s, once the device, the dtype and the model's files are known)."""
    from ..errors import DflashError
    from ..storage import Store
    from .header import build_header, in_form_of, resume_plan
    from .placement import min_shard_tokens
    from .plan import scan_rows
    from .progress import Progress, format_summary, summarise
    from .template import load_template
    from .worker import WorkerSpec, auto_writer_threads, feature_runner, host_buffers

    # Everything that can refuse the run (devices, data, a folder without weights, an architecture dflash cannot
    # run) is checked before the store exists, so a refused run leaves no store behind.
    try:
        with tl.stage("model_config"):
            template = load_template(tokenizer, cfg.chat_template)
        t0 = time.perf_counter()
        with tl.stage("read"):
            rows = read_rows(cfg.data)
        log.info("read %d rows of %s in %.1f s", len(rows), ", ".join(cfg.data), time.perf_counter() - t0)
        plan_t0 = time.perf_counter()
        scan = scan_rows(rows, cfg.max_length, cfg.strict)  # the one pass that parses every row here
        report_bad_rows(scan.bad)
        _require_usable(scan.bad, len(rows), cfg.data)
        # A sharded or offloaded target's default shards hold several of its batches (extract/placement.py).
        launched = ranks_from_env().world
        world = launched if launched > 1 else len(devices)
        min_tokens = min_shard_tokens(placement, sum(t for t in scan.tokens if t > 0), world)
        header = build_header(cfg, model_config, tokenizer, template, scan, min_shard_tokens=min_tokens)
        header = in_form_of(resume_plan(header, stored, cfg.shard_size), stored)
        # The pinned host buffers are page-locked on a thread from here, beside the target's load.
        buffers = host_buffers(cfg, header, devices[0]) if loader is not None else None
        plan = _plan(cfg, header, rows, scan, devices)
        if cfg.dry_run:
            return _dry_run(cfg, header, plan, tokenizer, template, placement, len(devices))
        if not cfg.force:  # an estimate: no second model load, no extra tokenising pass (--dry-run measures)
            plan.check_fits(cfg.out)
        tl.add("plan", time.perf_counter() - plan_t0)
        runner, runner_t0 = None, time.perf_counter()
        if loader is not None:
            with tl.stage("model_wait"):
                loader.checked()
                model = loader.result()
            with tl.stage("runner"):  # the truncated runner's self-check refuses a target it cannot run exactly
                runner = feature_runner(cfg, header, model, plan.tokens_left)
            header = _with_kernels(header, runner)
        runner_s = time.perf_counter() - runner_t0
    except DflashError:
        if loader is not None:
            loader.checked()  # the architecture's refusal comes first, as when it was checked before the data
        raise
    store_t0 = time.perf_counter()
    try:
        # A store left by a run that failed before its first shard holds nothing: other options may take it over.
        store = Store.create_or_open(cfg.out, header, replace_skeleton=True)
        committed = set(store.committed_ids())
        finished = store.is_complete() and len(committed) >= store.num_shards
        try:
            store.gc()  # temp files and claims of killed runs; never a live writer's (see Store.gc)
        except OSError as e:
            if not finished or e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            # A complete store is read, never written: on a read-only mount its leftovers simply stay.
            log.info("%s is complete and read-only here: leftovers of killed runs stay (%s)", cfg.out, e.strerror)
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise StoreError(f"--out {cfg.out}: cannot write the store there ({e.strerror}); pass a writable --out, "
                         "or make this one writable and rerun the same command") from None
    tl.add("store", time.perf_counter() - store_t0)
    world = ranks_from_env().world
    before = set(committed)
    run_t0 = time.perf_counter()
    run_rows = (lambda: plan.rows_of(set(store.committed_ids()) - before)) if world > 1 else None
    progress = Progress(plan.rows_of(plan.left(committed)), show=rank == 0, run_rows=run_rows, world=world)
    base = 0 if local_rank is None else rank
    threads = cfg.writer_threads or auto_writer_threads(len(devices))
    specs = [WorkerSpec(device=d, index=base + i, header=store.header, writer_threads=threads)
             for i, d in enumerate(devices)]
    log.info(
        "extract %s: %d rows in %d shards (%d committed), layers %s, mask token %d, %d worker(s) on %s, %d writer "
        "threads each",
        cfg.out, len(plan.rows), plan.num_shards, len(committed), header["layer_ids"], header["mask_token_id"],
        len(devices), ",".join(devices), threads,
    )
    try:
        results = _run_workers(cfg, specs, plan, progress, tl, tokenizer, template, runner, runner_s, buffers)
    except Exception:
        # A run that made this store and failed before its first commit (a target that fails to load, weights that
        # are not finite, a self-check that refuses) leaves no skeleton behind; peers launched beside it may still
        # be writing, so only a world of one removes it.
        if stored is None and ranks_from_env().world == 1 and store.discard_if_skeleton():
            log.info("removed %s: this run made it and committed nothing", cfg.out)
        raise
    finally:
        progress.close()
    summary_t0 = time.perf_counter()
    # Under torchrun this process's lines name its own devices only: the whole run's rate comes from the store,
    # every rank's commits since this rank started.
    summary = summarise(store, results, since=(before, world, time.perf_counter() - run_t0) if world > 1 else None)
    done = len(store.committed_ids()) >= store.num_shards
    if done and summary["samples"] == 0:
        raise InputError(
            f"--data {' '.join(cfg.data)}: no row became a sample ({_counts(summary['dropped'])}), so {cfg.out} "
            "holds 0 samples; fix the data, or lower --min-loss-tokens / raise --max-length"
        )
    if done and not finished:
        # Whoever sees every shard committed records the dataset totals (peers may do it too: same content).
        store.mark_complete({k: v for k, v in summary.items() if k not in ("devices", "this_run")}
                            | {"config": cfg.to_dict()})
    elif rank == 0:
        log.info("other workers still hold shards; the last one to finish marks the store complete")
    if rank == 0:
        click.echo(format_summary(summary, cfg.out), err=True)
    tl.add("summary", time.perf_counter() - summary_t0)
    _report_timelines(cfg, results, tl if len(specs) == 1 else None)
    return summary


def _with_kernels(header: dict[str, Any], runner: Any) -> dict[str, Any]:
    """Return the header with the kernels the checked runner chose (targets/kernels.py), an informational field: a
    store resumed in other kernels (another GPU, another transformers) is the same store, and every commit record
    says which kernels made its shard. A store from before they were recorded keeps its header as it is."""
    if "kernels" not in header.get("informational", []):
        return header
    return {**header, "kernels": runner.kernels.to_dict()}


def _run_workers(cfg: "ExtractConfig", specs: list[Any], plan: Any, progress: Any, tl: Any, tokenizer: Any,
                 template: str, runner: Any, runner_s: float, buffers: Any) -> list[dict[str, Any]]:
    """Return each worker's result: the one in this process (with the target's runner already made and checked
    when there is one, and the seconds waited for it), or the spawned ones."""
    from .template import ChatEncoder
    from .worker import run_worker

    if len(specs) == 1:
        # The tokenizer read above serves the worker too (a second load cost a second of start-up).
        encoder = (ChatEncoder(tokenizer, template, cfg.max_length, cfg.chat_template_kwargs),
                   tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        return [run_worker(cfg, specs[0], plan, progress.update, timeline=tl, encoder=encoder,
                           runner=runner, runner_s=runner_s, buffers=buffers)]
    return _run_spawned(cfg, specs, plan, progress)


def _report_timelines(cfg: "ExtractConfig", results: list[dict[str, Any]], own: Any) -> None:
    """Log each worker's timeline in one line and write them to --profile (a one-device run's is this process's,
    finished now, so its wall is the whole command's)."""
    from .timeline import format_line, write_profile

    workers = []
    for r in results:
        t = r.get("timeline")
        if t is None:
            continue
        if own is not None:
            t = {**t, **own.to_dict(device=t.get("device"), pid=t.get("pid"), index=t.get("index"))}
        workers.append(t)
        log.info("%s", format_line(t))
    if cfg.profile:
        write_profile(cfg.profile, workers, command="extract", out=cfg.out)
        log.info("wrote the timeline of %d worker(s) to %s", len(workers), cfg.profile)
