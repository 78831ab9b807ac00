"""Teacher-forced evaluation of a drafter on a store's held-out shards: loss, per-slot accuracy/acceptance, tau_hat."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from ..drafter.config import check_compatible
from ..drafter.tree import TREE_BUDGETS
from ..errors import CorruptShard, InputError

if TYPE_CHECKING:
    import torch

    from ..config import EvalConfig
    from ..drafter.model import DFlashDrafter
    from ..targets.head import TargetHead
    from ..storage import Store

__all__ = ["evaluate_shards", "run_eval", "format_eval"]

log = logging.getLogger(__name__)


def evaluate_shards(
    model: "DFlashDrafter",
    head: "TargetHead",
    store: "Store",
    shard_ids: list[int],
    *,
    batch_tokens: int,
    anchors: int,
    seed: int = 0,
    attention: str = "sdpa",
    device: "torch.device | str" = "cpu",
    skip_corrupt: bool = False,
    tree_budgets: Sequence[int] = TREE_BUDGETS,
) -> dict[str, Any]:
    """Return teacher-forced metrics over every sample of the shards: loss, acc, slot_accuracy, accept_rate
    (fraction of blocks whose first k drafts are all right, k = 1..B-1), tau_hat = 1 + mean streak, counts, and
    tree_tau: for each N of tree_budgets, 1 + the mean depth of the longest gold prefix inside the block's DDTree of
    N nodes (drafter/tree.py; built from the drafter's own per-slot distributions, for DFlash 2 the unary logits),
    and for DFlash 2 selector_tree_tau, the same in the selector's tree (selector_loss.selector_tree_depths).

    The loss is decay-weighted whatever the run trained with (loss_weights says so): D-PACE's weights follow the
    drafter's own confidences, so its loss would not compare across drafters; tau_hat and accuracy are unweighted.
    """
    import torch

    from .objective import predict
    from .packing import batch_capacity, max_blocks_for, pack_batch

    cfg = model.config
    B = cfg.block_size
    capacity = batch_capacity(batch_tokens)  # one flex shape for every batch, as in training
    hits = torch.zeros(B - 1, dtype=torch.float64)
    counts = torch.zeros(B - 1, dtype=torch.float64)
    streak_hist = torch.zeros(B, dtype=torch.float64)  # blocks with streak exactly s, s = 0..B-1
    ce, wsum, tokens, skipped = 0.0, 0.0, 0, []
    sums: list[Any] = []  # each batch's Metrics, for a DFlash 2 drafter's selector terms
    depth_sum = torch.zeros(len(tree_budgets), dtype=torch.float64)
    sel_depth_sum = torch.zeros(len(tree_budgets), dtype=torch.float64)
    was_training = model.training
    model.eval()

    def flush(seqs: list[dict[str, Any]], k: int) -> None:
        nonlocal ce, wsum
        batch = pack_batch(seqs, block_size=B, mask_token_id=cfg.mask_token_id, max_anchors=anchors,
                           max_blocks=max_blocks_for(batch_tokens), seed=seed * 1_000_003 + k).to(device)
        if batch.num_blocks == 0:
            return
        p = predict(model, batch, head.embed, head.lm_head, attention=attention, capacity=capacity,
                    tree_budgets=tuple(tree_budgets))
        if p.tree_depths is not None:
            depth_sum.add_(p.tree_depths.double().sum(0).cpu())
        if p.selector_tree_depths is not None:
            sel_depth_sum.add_(p.selector_tree_depths.double().sum(0).cpu())
        correct, counted, c, w = p.correct, p.counted, p.ce_sum, p.weight_sum
        hit = (correct & counted).double().cpu()
        hits.add_(hit.sum(0))
        counts.add_(counted.double().cpu().sum(0))
        streak = torch.cumprod(hit, dim=1).sum(1).long()
        streak_hist.add_(torch.bincount(streak, minlength=B).double())
        ce, wsum = ce + c, wsum + w
        if p.selector is not None:
            sums.append(p.metrics())

    with torch.no_grad():
        k = 0
        for sid in shard_ids:
            try:
                data = store.read_shard(sid)
            except CorruptShard as e:
                if not skip_corrupt:
                    raise
                log.warning("skipping corrupt shard: %s", e)
                skipped.append(sid)
                continue
            seqs: list[dict[str, Any]] = []
            used = 0
            for i in range(data.num_samples):
                ids, mask, feats = data.sample(i)
                n = min(len(ids), batch_tokens)
                if seqs and used + n > batch_tokens:
                    flush(seqs, k)
                    k, seqs, used = k + 1, [], 0
                seqs.append({"input_ids": ids[:n], "loss_mask": mask[:n], "features": feats[:n]})
                used += n
                tokens += n
            if seqs:
                flush(seqs, k)
                k += 1
    model.train(was_training)
    blocks = float(streak_hist.sum())
    at_least = streak_hist.flip(0).cumsum(0).flip(0)  # blocks with streak >= s
    selector = sum(sums[1:], sums[0]).selector_dict() if sums else {}
    return {
        **selector,
        "loss": ce / wsum if wsum else float("nan"),
        "loss_weights": "decay",
        "acc": float(hits.sum() / counts.sum()) if counts.sum() else float("nan"),
        "slot_accuracy": [float(h / c) if c else float("nan") for h, c in zip(hits, counts)],
        "accept_rate": [float(at_least[s] / blocks) if blocks else float("nan") for s in range(1, B)],
        "tau_hat": 1.0 + (float((streak_hist * torch.arange(B)).sum()) / blocks if blocks else 0.0),
        "tree_budgets": list(tree_budgets),
        "tree_tau": [1.0 + (float(d) / blocks if blocks else 0.0) for d in depth_sum],
        **({"selector_tree_tau": [1.0 + (float(d) / blocks if blocks else 0.0) for d in sel_depth_sum]}
           if model.config.drafter == "dflash2" and tree_budgets else {}),
        "blocks": int(blocks),
        "tokens": tokens,
        "shards": [s for s in shard_ids if s not in skipped],
        "skipped_corrupt": skipped,
    }


def run_eval(cfg: "EvalConfig") -> dict[str, Any]:
    """Return the evaluation of a drafter (run, checkpoint or export folder) on a store's held-out shards."""
    import torch

    from ..drafter.files import load_drafter
    from ..drafter.folders import resolve_drafter
    from ..targets.head import load_target_head
    from ..config import DTYPES
    from ..targets.numerics import compute_context, resolve_dtype
    from ..storage import Store
    from .plan import split_shards

    folder, record = resolve_drafter(cfg.drafter)
    batch_tokens, anchors = cfg.batch_tokens, cfg.anchors  # a run's own values win below
    store = Store.open(cfg.store)
    store.use_cache(cfg.cache_dir, cfg.cache_gb)
    model = load_drafter(folder, dtype=torch.float32)
    check_compatible(model.config, store.header, str(folder), cfg.store)
    committed = set(store.committed_ids())
    if cfg.shards == "all":
        ids, split = sorted(committed), "all committed shards"
    elif record is not None and cfg.val_fraction is None:
        ids, split = list(record["resolved"]["val_shards"]), f"held-out shards of run {folder.parent.parent}"
        # The run's own batch, or a smaller one asked for (a batch that ran out of memory).
        batch_tokens = min(record["config"]["batch_tokens"], cfg.batch_tokens)
        anchors = min(record["config"]["anchors"], cfg.anchors)
    elif cfg.val_fraction:
        ids = split_shards(store.num_shards, cfg.val_fraction)[1]
        split = f"held-out shards of --val-fraction {cfg.val_fraction}"
    else:
        raise InputError(
            f"--drafter {cfg.drafter}: an export carries no record of its run's held-out shards; pass "
            "--val-fraction F (the value used in training) or --shards all"
        )
    if not ids:  # a run of a small store holds out nothing by default: score what there is, and say so
        ids = sorted(committed)
        split = "all committed shards: the run held out none, so these are its training shards (scores are optimistic)"
        log.warning("--drafter %s: its run held out no shards (--val-fraction %s); evaluating on all %d committed "
                    "shards, which it trained on", cfg.drafter, (record or {}).get("config", {}).get("val_fraction", cfg.val_fraction), len(ids))
    missing = sorted(set(ids) - committed)
    if missing:
        raise InputError(f"--store {cfg.store}: the {split} {missing} are not committed (committed: "
                         f"{len(committed)} of {store.num_shards}); finish the store with `dflash extract`")
    head_dir = cfg.target or (record or {}).get("config", {}).get("target") or store.header["target"]["path"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    # As training validates: fp32 weights, the head in the compute dtype, bf16 autocast for bfloat16; auto takes a
    # run's own dtype (eval then repeats its validation numbers) unless this CPU would emulate bf16.
    recorded = (record or {}).get("config", {}).get("dtype")
    dtype = resolve_dtype(cfg.dtype, device.type, prefer=recorded if recorded in DTYPES else None,
                          auto_reason=f"the run {folder.parent.parent} trained and validated in it")
    head = load_target_head(head_dir, dtype=getattr(torch, dtype), device=device)
    with compute_context(device.type, dtype):
        out = evaluate_shards(model, head, store, ids, batch_tokens=batch_tokens, anchors=anchors, device=device,
                              attention="flex" if device.type == "cuda" else "sdpa", skip_corrupt=cfg.skip_corrupt,
                              tree_budgets=cfg.tree_budgets)
    # The other committed shards are the ones trained on (unknown when every shard is scored).
    trained = sorted(committed - set(ids))
    out.update(drafter=str(folder), store=cfg.store, split=split, dtype=dtype,
               tokens_trained_on=None if cfg.shards == "all" else
               sum(int(store.commit_record(i).get("num_tokens", 0)) for i in trained),
               held_out_samples=sum(int(store.commit_record(i).get("num_samples", 0)) for i in out["shards"]))
    return out


def format_eval(result: dict[str, Any]) -> str:
    """Return the human-readable summary of run_eval's result."""
    lines = [
        f"drafter    {result['drafter']}",
        f"store      {result['store']} ({result['split']}: {len(result['shards'])} shards, {result['tokens']:,} tokens, "
        f"{result['blocks']:,} blocks)",
        f"tau_hat    {result['tau_hat']:.3f} (teacher-forced, {result['held_out_samples']:,} samples"
        + (f"; trained on {result['tokens_trained_on']:,} tokens of the other shards)"
           if result.get("tokens_trained_on") is not None else ")"),
        f"loss       {result['loss']:.4f} ({result.get('loss_weights', 'decay')} weights)   acc {result['acc']:.3f}"
        + (f"   (computed in {result['dtype']})" if result.get("dtype") else ""),
        "slot       " + " ".join(f"{k + 1:>5d}" for k in range(len(result["slot_accuracy"]))),
        "accuracy   " + " ".join(f"{a:5.3f}" for a in result["slot_accuracy"]),
        "acceptance " + " ".join(f"{a:5.3f}" for a in result["accept_rate"]),
    ]
    if result.get("tree_budgets"):
        lines.append("tree tau   " + "   ".join(f"N={n} {t:.3f}" for n, t in zip(result["tree_budgets"],
                                                                               result["tree_tau"]))
                     + " (DDTree of N nodes, teacher-forced)")
    if result.get("selector_tree_tau"):
        lines.append("selector   " + "   ".join(f"N={n} {t:.3f}" for n, t in zip(result["tree_budgets"],
                                                                               result["selector_tree_tau"]))
                     + " (DFlash 2's selector tree of N nodes)")
    if result["skipped_corrupt"]:
        lines.append(f"skipped    corrupt shards {result['skipped_corrupt']}")
    return "\n".join(lines)
