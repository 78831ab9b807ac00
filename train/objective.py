"""The DFlash training objective on a packed batch (packing.py): D-PACE position weights, the chunked lm_head loss and
the metrics; `drafter_loss` runs the drafter and the chunked cross-entropy."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import InputError
from ..drafter.batch import PackedBatch
from ..drafter.linear_ce import chunked_linear_ce_rows, chunked_linear_ce_topk
from ..drafter.model import block_embeddings
from .selector_loss import selector_loss, selector_tree_depths
from .tree_loss import tree_terms

__all__ = [
    "dpace_weights",
    "loss_denominator",
    "Metrics",
    "Prediction",
    "predict",
    "drafter_loss",
    "block_metrics",
]

log = logging.getLogger(__name__)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Return D-PACE's detached position weights [blocks, B] of per-slot CE [blocks, B] (arXiv 2605.18810, Eq. 7-8).

    q_i = exp(-CE_i) is the drafter's confidence in the label, q~_i = (1 - alpha) q_i + alpha (alpha floors it), and
    w_j = sum_{m >= j} prod_{i <= m} q~_i: d E[accepted length] / d log q_j, the credit slot j has in the block's
    expected accepted length. An invalid slot (the anchor, past the sequence end, outside the loss mask) weighs 0
    and leaves the products alone (q~ = 1), as the paper's code and SpecForge / speculators treat padding. Pass the
    block's own CE, never a loss that another objective (a DFlash 2 selector miss) has masked: the weights of
    later slots must not change with it.
    """
    with torch.no_grad():
        q = torch.exp(-ce.detach().to(torch.promote_types(ce.dtype, torch.float32)))
        v = valid.to(torch.bool)
        smooth = torch.where(v, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        reach = torch.cumprod(smooth, dim=-1) * v
        return reach.flip(-1).cumsum(-1).flip(-1) * v


def loss_denominator(weights: torch.Tensor, position_weights: str = "decay") -> float:
    """Return what the loss of a batch with these [blocks, B] PackedBatch weights divides by, before any forward.

    decay: the sum of the decay weights (a weighted mean CE); dpace: the blocks with a counted slot (D-PACE is a
    per-block sum of credits; dividing by the weights would cancel their mass, SpecForge #828 / #848). Known before
    the forward, so the learner adds it over ranks and micro-batches and every layout gets the same gradient.
    """
    counted = weights[:, 1:]
    if position_weights == "dpace":
        return float((counted > 0).any(dim=1).sum())
    return float(counted.sum())


@dataclass
class Metrics:
    """Sums and counts of one or more steps; add them across steps and ranks, then read the rates.

    ce_sum: sum of w_k * CE_k; weight_sum: what the loss divides by (loss_denominator: sum of w_k for decay, the
    counted blocks for dpace); slot_correct / slot_count [B-1]: correct and counted predictions of slots 1..B-1;
    streak_sum: sum over blocks of leading correct slots; blocks: number of blocks; slot_weight [B-1]: sum of the
    loss weights of each slot (None: not kept, read as zeros).
    """

    ce_sum: float
    weight_sum: float
    slot_correct: list[int]
    slot_count: list[int]
    streak_sum: int
    blocks: int
    slot_weight: list[float] | None = None
    # DFlash 2's candidate selector (train/selector_loss.py): sum of w * CE_sel, its serving picks right, gold in the
    # top-K, slots it scored (0 for a DFlash 1 drafter), and the streaks of its picks.
    selector_ce_sum: float = 0.0
    selector_correct: int = 0
    selector_covered: int = 0
    selector_count: int = 0
    selector_streak_sum: int = 0
    # --tree-loss-nodes and --accept-loss (train/tree_loss.py): their weighted sums over the same denominator as ce_sum.
    tree_sum: float = 0.0
    accept_sum: float = 0.0

    @property
    def loss(self) -> float:
        """Return the weighted mean cross-entropy sum w CE / sum w (0 without counted slots)."""
        return self.ce_sum / self.weight_sum if self.weight_sum else 0.0

    @property
    def slot_accuracy(self) -> list[float]:
        """Return the top-1 accuracy of each slot 1..B-1 (nan where no slot was counted)."""
        return [c / n if n else float("nan") for c, n in zip(self.slot_correct, self.slot_count)]

    @property
    def slot_mean_weight(self) -> list[float]:
        """Return the mean loss weight of each slot 1..B-1 over its counted predictions (nan where none)."""
        weights = self.slot_weight or [0.0] * len(self.slot_count)
        return [w / n if n else float("nan") for w, n in zip(weights, self.slot_count)]

    @property
    def tau_hat(self) -> float:
        """Return 1 + mean streak: the expected tokens per block under greedy verification, teacher-forced."""
        return 1.0 + (self.streak_sum / self.blocks if self.blocks else 0.0)

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Return every sum as one float64 vector (for torch.distributed.all_reduce)."""
        weights = self.slot_weight or [0.0] * len(self.slot_count)
        vals = [self.ce_sum, self.weight_sum, self.streak_sum, self.blocks, *self.slot_correct, *self.slot_count,
                *weights, self.selector_ce_sum, self.selector_correct, self.selector_covered, self.selector_count,
                self.selector_streak_sum, self.tree_sum, self.accept_sum]
        return torch.tensor(vals, dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Metrics":
        """Return the Metrics of a vector made by to_tensor (possibly summed across ranks)."""
        v = t.double().cpu().tolist()
        n = (len(v) - 11) // 3
        sel = v[4 + 3 * n:-2]
        return cls(v[0], v[1], [round(x) for x in v[4:4 + n]], [round(x) for x in v[4 + n:4 + 2 * n]], round(v[2]),
                   round(v[3]), v[4 + 2 * n:4 + 3 * n], sel[0], *(round(x) for x in sel[1:]), v[-2], v[-1])

    def __add__(self, other: "Metrics") -> "Metrics":
        return Metrics.from_tensor(self.to_tensor() + other.to_tensor())

    def objective_dict(self) -> dict[str, Any]:
        """Return the --tree-loss-nodes and --accept-loss terms that ran (none when off): loss_tree and loss_accept, their
        sums over the block loss's denominator (the objective adds them to `loss`)."""
        out = {}
        if self.tree_sum:
            out["loss_tree"] = self.tree_sum / self.weight_sum if self.weight_sum else 0.0
        if self.accept_sum:
            out["loss_accept"] = self.accept_sum / self.weight_sum if self.weight_sum else 0.0
        return out

    def selector_dict(self) -> dict[str, Any]:
        """Return DFlash 2's terms (none for a DFlash 1 drafter): loss_block (= loss, the drafter's own CE),
        loss_selector (its weighted CE; the objective is their sum), the selector's accuracy and tau_hat from its
        serving picks, and topk_recall (gold token among the top-K)."""
        if not self.selector_count:
            return {}
        n = self.selector_count
        return {"loss_block": self.loss,
                "loss_selector": self.selector_ce_sum / self.weight_sum if self.weight_sum else 0.0,
                "selector_acc": self.selector_correct / n, "topk_recall": self.selector_covered / n,
                "selector_tau_hat": 1.0 + (self.selector_streak_sum / self.blocks if self.blocks else 0.0)}


def block_metrics(correct: torch.Tensor, counted: torch.Tensor) -> tuple[list[int], list[int], int]:
    """Return (correct per slot, counted per slot, sum of streaks) for [A, B-1] boolean predictions of slots 1..B-1.

    A block's streak is its number of leading slots that are counted and correct; a slot that is not counted
    (beyond the sequence or outside the loss mask) ends the streak, since nothing past it could be accepted.
    """
    hit = correct & counted
    streak = torch.cumprod(hit.int(), dim=1).sum()
    return hit.sum(0).tolist(), counted.sum(0).tolist(), int(streak)


@dataclass
class Prediction:
    """The drafter's predictions on one packed batch: the loss, and per block slot 1..B-1 what was right.

    correct / counted [A, B-1]: the top-1 prediction equals the label / the slot counts (its weight is > 0);
    ce_sum: sum of w_k * CE_k; weight_sum: the loss's denominator (loss_denominator); slot_weight [B-1]: sum of
    w_k per slot.
    """

    loss: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    ce_sum: float
    weight_sum: float
    slot_weight: list[float]
    selector: dict[str, Any] | None = None  # DFlash 2: selector_loss's sums (see Metrics)
    objective: dict[str, float] | None = None  # tree_sum and accept_sum (see Metrics)
    tree_depths: torch.Tensor | None = None  # [A, budgets]: the gold prefix's depth in each tree (tree_budgets)
    selector_tree_depths: torch.Tensor | None = None  # the same in DFlash 2's selector tree
    sums: torch.Tensor | None = None  # predict(host_sync=False): the Metrics vector, still on the device

    def metrics(self) -> Metrics:
        """Return the batch's Metrics (sums and counts that add across steps and ranks)."""
        if self.sums is not None:
            return Metrics.from_tensor(self.sums)
        slot_correct, slot_count, streak = block_metrics(self.correct, self.counted)
        return Metrics(ce_sum=self.ce_sum, weight_sum=self.weight_sum, slot_correct=slot_correct,
                       slot_count=slot_count, streak_sum=streak, blocks=self.correct.shape[0],
                       slot_weight=self.slot_weight, **(self.selector or {}), **(self.objective or {}))


def predict(
    model: torch.nn.Module,
    batch: PackedBatch,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    attention: str = "sdpa",
    chunk_rows: int | None = None,
    capacity: tuple[int, int] | None = None,
    position_weights: str = "decay",
    dpace_alpha: float = 0.5,
    host_sync: bool = True,
    tree_loss: int = 0,
    accept_loss: bool = False,
    tree_budgets: Sequence[int] = (),
) -> Prediction:
    """Return the Prediction of the drafter on one packed batch, its loss = sum_k w_k CE_k / loss_denominator.

    attention "sdpa" (dense boolean mask, any device) or "flex" (block mask, CUDA). embed_weight and
    lm_head_weight are the target's frozen tensors. The lm_head runs only on counted slots, in chunks.
    capacity (see packing.batch_capacity) gives flex one shape for the whole run. position_weights "decay" takes the
    batch's weights, "dpace" D-PACE weights of this forward's CE (dpace_weights) on the batch's counted slots.
    host_sync False: the metric sums stay on the device (Prediction.sums; the float fields are nan and
    `selector` None), so the forward waits on the device only for the counted rows, not for a dozen small sums.
    tree_loss N > 0 and accept_loss add train/tree_loss.py's terms (over the same denominator); tree_budgets gives
    Prediction.tree_depths, the metric. Either takes each row's CE differentiable (D-PACE's path).
    """
    from ..drafter.attention import make_attend

    cfg = model.config if hasattr(model, "config") else model.module.config
    B = batch.block_size
    if B != cfg.block_size:
        raise InputError(f"batch has blocks of {B} slots but the drafter was built for {cfg.block_size}")
    attend = make_attend(batch, cfg, attention, capacity)
    block_pos = batch.block_pos.reshape(-1)
    embeds = block_embeddings(cfg, batch.block_ids.reshape(-1), embed_weight.detach())
    hidden = model(batch.features, batch.ctx_pos, embeds, block_pos, attend)  # [A*B, H]
    w = batch.weights[:, 1:]
    counted = w > 0
    rows = torch.nonzero(counted.reshape(-1), as_tuple=False)[:, 0]  # waits for the device: the one sync it needs
    h = hidden.view(-1, B, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1]).index_select(0, rows)
    labels = batch.labels[:, 1:].reshape(-1).index_select(0, rows)
    logit_scales = dict(multiplier=cfg.output_multiplier, softcap=cfg.final_logit_softcapping)
    sel_k = cfg.selector_top_k if cfg.drafter == "dflash2" else 0
    tree_k = max([tree_loss, *tree_budgets]) if tree_loss or tree_budgets else 0
    top_k = min(max(sel_k, tree_k), lm_head_weight.shape[0])  # the selector takes its K of them, largest first
    if position_weights == "dpace" or tree_loss or accept_loss:
        ce, pred, top, top_lp = chunked_linear_ce_rows(h, lm_head_weight, labels, chunk_rows, top_k=top_k,
                                                       **logit_scales)
        if position_weights == "dpace":
            grid = torch.zeros(counted.numel(), dtype=ce.dtype, device=ce.device)
            grid[rows] = ce.detach()
            # From the block CE alone: a selector top-K miss never moves a later position's weight.
            row_w = dpace_weights(grid.view_as(counted), counted, dpace_alpha).reshape(-1).index_select(0, rows)
            if host_sync:
                denominator = torch.tensor(loss_denominator(batch.weights, "dpace"), dtype=ce.dtype, device=ce.device)
            else:  # the same count, formed on the device (a host value would be copied up and wait for the device)
                denominator = (w > 0).any(dim=1).sum().to(ce.dtype)
        else:
            row_w, denominator = w.reshape(-1).index_select(0, rows), w.sum()
        loss = (ce * row_w).sum() / denominator.clamp(min=1e-12)
    else:
        row_w = w.reshape(-1).index_select(0, rows)
        denominator = w.sum()
        scale = row_w / denominator.clamp(min=1e-12)
        loss, ce, pred, top, top_lp = chunked_linear_ce_topk(h, lm_head_weight, labels, scale, top_k, chunk_rows,
                                                             **logit_scales)
    terms = None
    if tree_k or accept_loss:
        terms = tree_terms(ce, top_lp, rows, counted, row_w, tree_budget=tree_loss, accept=accept_loss,
                           budgets=tree_budgets)
        loss = loss + (terms.tree_sum + terms.accept_sum) / denominator.clamp(min=1e-12)
    selector, sel_depths = None, None
    if cfg.drafter == "dflash2":
        top = top[:, :sel_k]
        scale = row_w.detach() / denominator.clamp(min=1e-12)  # the block loss's own position weights
        prev = batch.labels[:, :-1].reshape(-1).index_select(0, rows)  # teacher forcing: the gold previous token
        sel = selector_loss(_inner(model).candidate_selector, cfg, h, lm_head_weight, top, labels, prev, scale)
        loss = loss + sel.loss
        selector = _selector_sums(sel, row_w.detach(), rows, counted) if host_sync else sel
        if tree_budgets:
            sel_depths = selector_tree_depths(_inner(model).candidate_selector, cfg, h.detach(), lm_head_weight, top,
                                              rows, counted, batch.block_ids[:, 0], batch.labels[:, 1:],
                                              tree_budgets)
    if rows.numel() == 0:
        loss = hidden.sum() * 0.0  # keeps the graph (DDP needs every parameter used) with a zero gradient
    correct = torch.zeros_like(counted).reshape(-1)
    correct[rows] = pred == labels
    slot_w = torch.zeros(counted.numel(), dtype=torch.float64, device=row_w.device)
    slot_w[rows] = row_w.detach().double()
    if not host_sync:
        sums = _device_sums(correct.view_as(counted), counted, (ce.detach() * row_w).sum(), denominator,
                            slot_w.view_as(counted).sum(0), selector, row_w.detach(), rows, terms)
        return Prediction(loss=loss, correct=correct.view_as(counted), counted=counted, ce_sum=float("nan"),
                          weight_sum=float("nan"), slot_weight=[], sums=sums)
    objective = None if terms is None else dict(tree_sum=float(terms.tree_sum.detach()),
                                                 accept_sum=float(terms.accept_sum.detach()))
    return Prediction(loss=loss, correct=correct.view_as(counted), counted=counted,
                      ce_sum=float((ce.detach() * row_w).sum()), weight_sum=float(denominator),
                      slot_weight=slot_w.view_as(counted).sum(0).tolist(), selector=selector, objective=objective,
                      tree_depths=None if terms is None else terms.depths,
                      selector_tree_depths=sel_depths)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """Return the drafter inside a DDP or compiled wrapper."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or getattr(model, "_orig_mod")
    return model


def _selector_sums(sel: Any, row_w: torch.Tensor, rows: torch.Tensor, counted: torch.Tensor) -> dict[str, Any]:
    """Return the Metrics fields of a batch's SelectorTerms (counted slots `rows` of the [A, B-1] layout)."""
    picks = torch.zeros_like(counted).reshape(-1)
    picks[rows] = sel.correct
    _, _, streak = block_metrics(picks.view_as(counted), counted)
    return dict(selector_ce_sum=float((sel.ce * row_w).sum()), selector_correct=int(sel.correct.sum()),
                selector_covered=int(sel.covered.sum()), selector_count=int(rows.numel()), selector_streak_sum=streak)


def _device_sums(correct: torch.Tensor, counted: torch.Tensor, ce_sum: torch.Tensor, weight_sum: torch.Tensor,
                 slot_weight: torch.Tensor, sel: Any, row_w: torch.Tensor, rows: torch.Tensor,
                 terms: Any = None) -> torch.Tensor:
    """Return Metrics.to_tensor's vector of one batch computed on the device: the same reductions as the host path
    (block_metrics, _selector_sums), each cast to float64 only after it is formed, so the numbers are equal."""
    hit = correct & counted
    streak = torch.cumprod(hit.int(), dim=1).sum()
    parts = [ce_sum.double()[None], weight_sum.double().reshape(1), streak.double()[None],
             torch.full((1,), counted.shape[0], dtype=torch.float64, device=counted.device),
             hit.sum(0).double(), counted.sum(0).double(), slot_weight.double()]
    if sel is not None:
        picks = torch.zeros_like(counted).reshape(-1)
        picks[rows] = sel.correct
        sel_hit = picks.view_as(counted) & counted
        parts += [(sel.ce * row_w).sum().double()[None], sel.correct.sum().double()[None],
                  sel.covered.sum().double()[None],
                  torch.full((1,), rows.numel(), dtype=torch.float64, device=counted.device),
                  torch.cumprod(sel_hit.int(), dim=1).sum().double()[None]]
    else:
        parts.append(torch.zeros(5, dtype=torch.float64, device=counted.device))
    if terms is not None:
        parts += [terms.tree_sum.detach().double().reshape(1), terms.accept_sum.detach().double().reshape(1)]
    else:
        parts.append(torch.zeros(2, dtype=torch.float64, device=counted.device))
    return torch.cat(parts)


def drafter_loss(model: torch.nn.Module, batch: PackedBatch, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, **options: Any) -> tuple[torch.Tensor, Metrics]:
    """Return (loss = sum_k w_k CE_k / loss_denominator over the batch, Metrics) for one packed batch; options are
    `predict`'s (attention, chunk_rows, capacity, position_weights, dpace_alpha)."""
    p = predict(model, batch, embed_weight, lm_head_weight, **options)
    return p.loss, p.metrics()
