"""Training never waits on its own bookkeeping: checkpoints written in the background, comparable throughput."""
from __future__ import annotations

import torch

from dflash.drafter.folders import find_checkpoint
from dflash.train.checkpoint import Checkpointer, read_trainer_state
from dflash.train.metrics import read_metrics
from test_train_run import opts, train


class _Part:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict:
        return {"t": self.t, "nested": [self.t, (self.t,)]}

    def load_state_dict(self, state: dict) -> None:
        self.t = state["t"]


def test_a_background_checkpoint_holds_the_state_of_its_step(tmp_path, tiny_qwen3, store):  # noqa: F811
    from safetensors.torch import load_file

    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter

    cfg = DrafterConfig.from_target(str(tiny_qwen3), target_layer_ids=(1, 2), mask_token_id=1, draft_layers=1,
                                    block_size=4)
    model = DFlashDrafter(cfg)
    part = _Part(torch.zeros(3))
    ckpt = Checkpointer(tmp_path / "run", keep=1)
    snap = ckpt.snapshot(5, model, {"opt": part}, {"step": 5})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # Training goes on while the write runs: the snapshot must not see it.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    part.t.add_(7.0)
    ckpt.save_in_background(snap)
    folder = ckpt.wait()
    assert folder == ckpt.step_dir(5) and find_checkpoint(tmp_path / "run") == folder
    saved = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(saved[k], before[k]) for k in before)
    state = read_trainer_state(folder)
    assert torch.equal(state["opt"]["t"], torch.zeros(3)) and state["step"] == 5
    # A second background save waits for the first, prunes to --keep, and leaves no temp folder.
    ckpt.save_in_background(ckpt.snapshot(6, model, {"opt": part}, {"step": 6}))
    assert ckpt.wait() == ckpt.step_dir(6)
    assert [s for s, _ in ckpt.folders()] == [6]
    assert not list((tmp_path / "run" / "checkpoints").glob(".*"))


def test_the_log_gives_query_tokens_and_flops_beside_context_tokens(tmp_path, tiny_qwen3, store):  # noqa: F811
    run = tmp_path / "run"
    train(**opts(store, tiny_qwen3, run, epochs=1, max_steps=3))
    steps = [r for r in read_metrics(run) if r.get("split") == "train"]
    assert steps and all(r["query_tokens_per_s"] > 0 and r["tflops_per_s"] > 0 for r in steps)
    assert all(r["mfu"] is None for r in steps)  # a CPU has no known peak: no made-up MFU


def test_the_progress_line_gives_query_tokens_and_mfu_beside_context_tokens(tmp_path, caplog):
    import logging

    from dflash.train.metrics import RunLog

    rec = {"split": "train", "step": 1, "epoch": 0, "loss": 1.0, "acc": 0.5, "tau_hat": 1.5, "lr": 1e-4,
           "grad_norm": 1.0, "tokens_per_s": 12345.0, "query_tokens_per_s": 6789.0, "tflops_per_s": 400.0,
           "mfu": 0.404, "data_wait": 0.01, "prefetch_depth": 2}
    with caplog.at_level(logging.INFO):
        log = RunLog(tmp_path, total_steps=2, start_step=0, tensorboard=False)
        try:
            log.step(rec)
            log.step({**rec, "step": 2, "mfu": None})  # a device of unknown peak: no made-up MFU
        finally:
            log.close()
    text = caplog.text
    assert "12,345 ctx tok/s 6,789 query tok/s MFU 40.4%" in text
    assert text.count("MFU") == 1


def test_a_resumed_runs_eta_comes_from_its_steps_not_its_start_up(tmp_path, monkeypatch, caplog):
    """train's log line: the ETA of a run resumed at step 400 of 1,000 that spent 5 minutes loading and compiling
    before its first step is its steps' own pace (2 s a step), and follows a change of pace within a minute."""
    import logging
    import types

    from dflash.runtime import process
    from dflash.train.metrics import RunLog

    clock = [50.0]
    monkeypatch.setattr(process, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    runlog = RunLog(tmp_path, total_steps=1000, start_step=400, tensorboard=False)
    clock[0] += 300.0  # the start-up: load, compile

    def step(n: int) -> None:
        runlog.step({"step": n, "epoch": 0, "loss": 1.0, "acc": 0.5, "tau_hat": 1.5, "lr": 1e-4, "tokens_per_s": 1e4,
                     "query_tokens_per_s": 1e3, "mfu": None, "data_wait": 0.0, "grad_norm": 1.0, "prefetch_depth": 2})

    with caplog.at_level(logging.INFO, logger="dflash.train.metrics"):
        for n in range(401, 451):
            clock[0] += 2.0
            step(n)
        assert caplog.records[-1].getMessage().endswith("ETA 0:18:20"), caplog.records[-1].getMessage()  # 550 x 2 s
        for n in range(451, 531):  # then twice as fast, for more than the minute the rate is taken over
            clock[0] += 1.0
            step(n)
            if n == 511:  # 61 s into it the ETA is the new pace's alone
                assert runlog.progress.eta() == 1000 - 511
        assert caplog.records[-1].getMessage().endswith("ETA 0:07:50"), caplog.records[-1].getMessage()  # 470 x 1 s
    runlog.close()
