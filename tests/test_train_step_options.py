"""learner.StepOptions (what bench/train.py --variants A/Bs): each gives the step of `dflash train` its own numbers."""
from __future__ import annotations

import pytest
import torch

from dflash.config import TrainConfig
from dflash.storage import Store
from dflash.train.dist import Dist
from dflash.train.learner import Learner, StepOptions
from dflash.train.packing import max_blocks_for, pack_batch
from dflash.drafter.config import for_store
from test_train_run import opts


def _micro(store_url: str, cfg: TrainConfig, dcfg, step: int) -> list:
    s = Store.open(store_url)
    shard = s.read_shard(s.committed_ids()[step % 3])
    seqs = []
    for i in range(len(shard.offsets) - 1):
        a, b = int(shard.offsets[i]), int(shard.offsets[i + 1])
        mask = torch.as_tensor(shard.loss_mask[a:b])
        seqs.append(dict(input_ids=torch.as_tensor(shard.input_ids[a:b]), features=shard.features[a:b].float(),
                         loss_mask=mask))
    return [pack_batch(seqs, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id, max_anchors=cfg.anchors,
                       max_blocks=max_blocks_for(cfg.batch_tokens), seed=step)]


def _run(store, target, tmp_path, options: StepOptions, weights: str, steps: int = 3):
    cfg = TrainConfig(**opts(store, target, tmp_path / "run", position_weights=weights, drafter="dflash2"))
    dcfg = for_store(cfg, Store.open(store).header)
    learner = Learner(cfg, dcfg, Dist(0, 1, torch.device("cpu")), options)
    learner.total = 10
    out = []
    for step in range(steps):
        metrics, gnorm, lr = learner.step(_micro(store, cfg, dcfg, step))
        out.append((metrics, gnorm, lr, learner.last_flops))
    return out, {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


@pytest.mark.parametrize("weights", ["decay", "dpace"])
def test_few_syncs_gives_the_same_step_bit_for_bit(store, tiny_qwen3, tmp_path, weights):  # noqa: F811
    base, w0 = _run(store, tiny_qwen3, tmp_path / "a", StepOptions(), weights)
    few, w1 = _run(store, tiny_qwen3, tmp_path / "b", StepOptions(few_syncs=True), weights)
    assert [x[1:] for x in base] == [x[1:] for x in few]  # grad norm, lr, FLOPs
    assert [x[0] for x in base] == [x[0] for x in few]  # every metric sum, the selector's too
    assert base[0][0].selector_count > 0
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_the_ce_chunk_size_changes_the_step_only_by_rounding(store, tiny_qwen3, tmp_path):  # noqa: F811
    base, w0 = _run(store, tiny_qwen3, tmp_path / "a", StepOptions(), "dpace")
    small, w1 = _run(store, tiny_qwen3, tmp_path / "b", StepOptions(chunk_rows=5), "dpace")
    for (m0, g0, _, _), (m1, g1, _, _) in zip(base, small):
        assert m1.loss == pytest.approx(m0.loss, rel=1e-5) and g1 == pytest.approx(g0, rel=1e-4)
        assert m1.slot_correct == m0.slot_correct
    assert all(torch.allclose(w0[k], w1[k], rtol=1e-4, atol=1e-6) for k in w0)


@pytest.mark.slow
def test_compiled_layers_change_the_step_only_by_rounding(store, tiny_qwen3, tmp_path):  # noqa: F811
    base, w0 = _run(store, tiny_qwen3, tmp_path / "a", StepOptions(), "dpace", steps=2)
    comp, w1 = _run(store, tiny_qwen3, tmp_path / "b", StepOptions(compile_layers=True), "dpace", steps=2)
    for (m0, g0, _, _), (m1, g1, _, _) in zip(base, comp):
        assert m1.loss == pytest.approx(m0.loss, rel=1e-4) and g1 == pytest.approx(g0, rel=1e-3)
    assert all(torch.allclose(w0[k], w1[k], rtol=1e-3, atol=1e-5) for k in w0)


@pytest.mark.parametrize("choice, device, expected", [("auto", "cuda", True), ("auto", "cpu", False),
                                                      ("on", "cpu", True), ("off", "cuda", False)])
def test_compile_layers_auto_compiles_on_cuda_only(store, tiny_qwen3, tmp_path, choice, device, expected):  # noqa: F811
    from dflash.train.learner import compiles

    cfg = TrainConfig(**opts(store, tiny_qwen3, tmp_path / "run", compile_layers=choice))
    assert compiles(cfg, torch.device(device)) is expected


def test_compile_layers_takes_only_its_choices(store, tiny_qwen3, tmp_path):  # noqa: F811
    from dflash.errors import DflashError

    with pytest.raises(DflashError, match="compile"):
        TrainConfig(**opts(store, tiny_qwen3, tmp_path / "run", compile_layers="sometimes"))
