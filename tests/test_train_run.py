"""`dflash train` and `dflash eval` end to end on a tiny target and a real store made by `dflash extract`."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.config import TrainConfig
from dflash.errors import ConfigError, CorruptShard, DflashError, ManifestMismatch
from dflash.storage import Store
from dflash.train.plan import split_shards
from dflash.train.metrics import read_metrics

ROWS, SHARD_ROWS = 24, 4
EXTRACT_ARGS = ["--gpus", "cpu", "--shard-size", str(SHARD_ROWS), "--batch-tokens", "1024", "--max-length", "256",
                "--min-loss-tokens", "4", "--dtype", "float32"]


def write_toy_data(path: Path) -> Path:
    """Write conversations whose answers follow a fixed pattern (learnable by a tiny drafter) after a random prompt."""
    rng = random.Random(0)
    words = "the a model token layer block draft target cache shard store verify".split()
    counting = "one two three four five six seven eight nine ten"
    with open(path, "w") as f:
        for i in range(ROWS):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
            answer = " ".join([counting] * rng.randint(2, 4))
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def opts(store: str, target: Path, out: Path, **over) -> dict:
    """Return train options of a tiny, fast run (fp32 on CPU so runs are bit-reproducible)."""
    base = dict(store=store, target=str(target), out=str(out), gpus="cpu", epochs=2, batch_tokens=512,
                draft_layers=1, block_size=8, anchors=32, dtype="float32", val_fraction=0.2, log_every=1,
                save_every=3, keep=2, seed=0)
    base.update(over)
    return base


def train(**kw) -> None:
    from dflash import train as stage

    stage.run(TrainConfig(**kw))


def flags(kw: dict) -> list[str]:
    """Return the command-line flags of train options."""
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, tuple):
            out += [flag, ",".join(str(x) for x in v)]
        elif v is not False and v is not None:
            out += [flag, str(v)]
    return out


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run) if r.get("split") == "train"]


def cli(*args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "dflash.cli", *args], env=env, start_new_session=True, **popen)


def dflash_main(capsys, *args: str) -> tuple[int, str, str]:
    """Return (exit code, stdout, stderr) of the `dflash` entry point run in this process."""
    from dflash.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_loss_falls_and_the_run_folder_has_everything(store, tiny_qwen3, tmp_path, capsys):
    run = tmp_path / "run"
    train(**opts(store, tiny_qwen3, run, epochs=3))
    records = read_metrics(run)
    steps = [r for r in records if r.get("split") == "train"]
    for key in ("step", "epoch", "loss", "acc", "tau_hat", "lr", "tokens_per_s", "data_wait", "slot_accuracy",
                "streak", "grad_norm", "prefetch_depth", "eta_s"):
        assert key in steps[0], key
    first, last = steps[0]["loss"], sum(r["loss"] for r in steps[-3:]) / 3
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    # The held-out split is recorded, never trained on, and validated on.
    record = json.loads((run / "config.json").read_text())
    train_ids, val_ids = split_shards(Store.open(store).num_shards, 0.2)
    assert record["resolved"]["val_shards"] == val_ids and record["config"]["val_fraction"] == 0.2
    ends = [r for r in records if r.get("event") == "epoch_end"]
    assert [e["epoch"] for e in ends] == [0, 1, 2]
    assert all(sorted(e["rounds"][0]) == train_ids for e in ends)
    vals = [r for r in records if r.get("split") == "val"]
    assert vals and all(r["shards"] == val_ids for r in vals)
    # The newest --keep checkpoints, the curves, and a checkpoint `dflash export` finds.
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(ckpts) == 2 and ckpts[-1] == f"step-{len(steps):06d}"
    assert (run / "curves.png").stat().st_size > 1000
    from dflash.drafter.folders import find_checkpoint

    assert find_checkpoint(run).name == ckpts[-1]
    # dflash eval on the run's held-out shards gives the final validation numbers.
    code, out, err = dflash_main(capsys, "eval", "--drafter", str(run), "--store", store, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["shards"] == val_ids and len(result["accept_rate"]) == 7
    assert result["tau_hat"] == pytest.approx(vals[-1]["tau_hat"]) and result["loss"] == pytest.approx(vals[-1]["loss"])
    assert result["accept_rate"] == sorted(result["accept_rate"], reverse=True)
    # It says what the drafter learnt from and what it was scored on.
    opened = Store.open(store)
    assert result["tokens_trained_on"] == sum(opened.commit_record(i)["num_tokens"] for i in train_ids) > 0
    assert result["held_out_samples"] == sum(opened.commit_record(i)["num_samples"] for i in val_ids) > 0
    assert len(result["slot_accuracy"]) == 7
    # A finished run is not overwritten, and a resume with another model shape is refused by field.
    with pytest.raises(ConfigError, match="pass --resume"):
        train(**opts(store, tiny_qwen3, run, epochs=3))
    with pytest.raises(ManifestMismatch, match="config.draft_layers: run has 1, now 2"):
        train(**opts(store, tiny_qwen3, run, epochs=3, draft_layers=2, resume=True))
    # Resuming a finished run with one more epoch trains exactly that epoch, continuing the step count.
    train(**opts(store, tiny_qwen3, run, epochs=4, resume=True))
    more = [r for r in read_metrics(run) if r.get("split") == "train"]
    assert [r["step"] for r in more] == list(range(1, len(more) + 1)) and len(more) > len(steps)
    assert [e["epoch"] for e in read_metrics(run) if e.get("event") == "epoch_end"] == [0, 1, 2, 3]


def sigkill_and_resume(store: str, target: Path, tmp_path: Path, kw: dict, first: int = 2, spare: int = 3) -> Path:
    """Train kw uninterrupted (tmp_path/full), then as a `dflash train` process SIGKILLed after a random step in
    first..(steps - spare), resumed in this process: assert the same losses step for step and the same last
    checkpoint, byte for byte (fp32 on CPU); return the uninterrupted run's folder."""
    full = tmp_path / "full"
    train(**opts(store, target, full, **kw))
    expected = losses(full)
    killed = tmp_path / "killed"
    kill_at = random.Random(os.getpid()).randint(first, max(first, len(expected) - spare))
    p = cli("train", *flags(opts(store, target, killed, **kw)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and p.poll() is None:
        if len(losses(killed)) >= kill_at:
            break
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert kill_at <= len(losses(killed)) < len(expected)
    train(**opts(store, target, killed, resume=True, **kw))
    assert losses(killed) == expected  # bit-exact on CPU: same steps, same losses
    # Every published checkpoint keeps its event, the one resumed from included (`dflash run` waits on them).
    events = [[r["step"] for r in read_metrics(run) if r.get("event") == "checkpoint"] for run in (full, killed)]
    assert events[0] == events[1] and events[0][-1] == len(expected)
    a = (full / "checkpoints" / f"step-{len(expected):06d}" / "model.safetensors").read_bytes()
    b = (killed / "checkpoints" / f"step-{len(expected):06d}" / "model.safetensors").read_bytes()
    assert a == b
    return full


def test_sigkill_then_resume_takes_exactly_the_uninterrupted_steps(store, tiny_qwen3, tmp_path):
    sigkill_and_resume(store, tiny_qwen3, tmp_path, dict(epochs=2, batch_tokens=256, save_every=2, keep=3), 4, 8)


@pytest.mark.slow
def test_two_gloo_processes_under_torchrun_or_our_launcher_equal_one_process_accumulating_two(store, tiny_qwen3, tmp_path):
    one = tmp_path / "one"
    kw = dict(epochs=1, batch_tokens=256)
    train(**opts(store, tiny_qwen3, one, grad_accum=2, **kw))
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dflash.cli",
           "train", *flags(opts(store, tiny_qwen3, two, **kw))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = losses(one), losses(two)
    assert len(a) >= 6 and [s for s, _ in a] == [s for s, _ in b]
    assert [x for _, x in b] == pytest.approx([x for _, x in a], rel=1e-5)
    assert json.loads((two / "config.json").read_text())["resolved"]["world_size"] == 2
    # Our own launcher (what `--gpus 5,6,7` uses) runs the same ranks.
    from dflash.train import launch_ranks

    three = tmp_path / "three"
    launch_ranks(TrainConfig(**opts(store, tiny_qwen3, three, **kw)), 2)
    assert losses(three) == b


@pytest.mark.slow
def test_follow_trains_while_extract_writes_and_sees_every_shard_once(tiny_qwen3, toy_data, tmp_path):
    out = tmp_path / "store"
    ext = cli("extract", "--model", str(tiny_qwen3), "--data", str(toy_data), "--out", str(out), *EXTRACT_ARGS,
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if Store.open(str(out)).committed_ids():
                break
        except DflashError:
            pass
        time.sleep(0.02)
    os.killpg(ext.pid, signal.SIGSTOP)  # hold extraction so training catches up and must wait
    try:
        s = Store.open(str(out))
        assert not s.is_complete(), "extract finished before training could follow it"
        run = tmp_path / "run"
        log_file = open(tmp_path / "train.log", "w")
        tr = cli("train", *flags(opts(str(out), tiny_qwen3, run, follow=True)), stdout=log_file, stderr=log_file)
        while time.monotonic() < deadline and "waiting for `dflash extract`" not in (tmp_path / "train.log").read_text():
            assert tr.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            time.sleep(0.1)
        trained_while_waiting = len(losses(run))
    finally:
        os.killpg(ext.pid, signal.SIGCONT)
    assert ext.wait(timeout=300) == 0
    assert tr.wait(timeout=300) == 0, (tmp_path / "train.log").read_text()[-3000:]
    assert trained_while_waiting >= 1
    train_ids, _ = split_shards(s.num_shards, 0.2)
    ends = [r for r in read_metrics(run) if r.get("event") == "epoch_end"]
    assert [e["epoch"] for e in ends] == [0, 1]
    rounds = ends[0]["rounds"]
    assert len(rounds) >= 2 and sorted(sum(rounds, [])) == train_ids  # every shard once, in several arrivals
    assert sorted(ends[1]["rounds"][0]) == train_ids


def test_a_corrupt_shard_is_named_or_skipped_and_counted(store, tiny_qwen3, tmp_path):
    bad_store = tmp_path / "store"
    shutil.copytree(store, bad_store)
    train_ids, _ = split_shards(Store.open(store).num_shards, 0.2)
    victim = train_ids[1]
    chunk = bad_store / "shards" / f"{victim:05d}" / "features" / "c.0.0.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptShard, match=rf"shards/{victim:05d}/features/c\.0\.0\.0.*--skip-corrupt"):
        train(**opts(str(bad_store), tiny_qwen3, tmp_path / "a", epochs=1))
    run = tmp_path / "b"
    train(**opts(str(bad_store), tiny_qwen3, run, epochs=1, skip_corrupt=True))
    ends = [r for r in read_metrics(run) if r.get("event") == "epoch_end"]
    assert ends[0]["corrupt_shards"] == [victim]


def test_eval_refuses_a_drafter_of_another_store_by_field(store, tiny_qwen3, tmp_path, capsys):
    from dflash.drafter.files import save_drafter_files
    from dflash.drafter.config import DrafterConfig
    from dflash.drafter.model import DFlashDrafter

    cfg = DrafterConfig.from_target(tiny_qwen3, target_layer_ids=[1, 2, 3], mask_token_id=5, draft_layers=1,
                                    block_size=8)
    save_drafter_files(DFlashDrafter(cfg), tmp_path / "ck")
    code, _, err = dflash_main(capsys, "eval", "--drafter", str(tmp_path / "ck"), "--store", store)
    message = err.strip()
    assert code == 2 and "\n" not in message and "Traceback" not in message
    assert "layer_ids: drafter has [1, 2, 3], store has [1, 2, 3, 4, 5]" in message
    assert "mask_token_id: drafter has 5" in message and "hidden_size" not in message


def test_tensorboard_missing_is_a_clear_error(store, tiny_qwen3, tmp_path):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(DflashError, match="pip install tensorboard"):
        train(**opts(store, tiny_qwen3, tmp_path / "run", tensorboard=True))
    assert not (tmp_path / "run").exists()


def test_the_step_total_plans_epochs_only_up_to_max_steps():
    from dflash.train.plan import planned_total

    asked: list[int] = []

    def epoch_steps(e: int) -> int:
        asked.append(e)
        return 8 + e % 2

    assert planned_total(epoch_steps, 0, 100_000, 700) == 700
    assert asked == list(range(len(asked))) and 700 <= sum(8 + e % 2 for e in asked) < 700 + 9
    asked.clear()
    assert planned_total(epoch_steps, 1, 4, 0, done=5) == 5 + 9 + 8 + 9 and asked == [1, 2, 3]
    assert planned_total(epoch_steps, 0, 3, 1000) == 8 + 9 + 8  # fewer planned steps than the cap


def test_max_steps_caps_a_run_of_a_million_epochs(store, tiny_qwen3, tmp_path):
    # Planning every one of a million epochs to find the step total would run for hours before the first step.
    run = tmp_path / "run"
    train(**opts(store, tiny_qwen3, run, epochs=1_000_000, max_steps=5, save_every=5))
    steps = [r for r in read_metrics(run) if r.get("split") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5] and steps[-1]["eta_s"] == 0


def test_pinned_buffers_of_several_sizes_are_reused_by_identity(store):
    import torch

    from dflash.train.prefetch import ShardPrefetcher, take_buffer

    small, big, bigger = (torch.zeros(n, dtype=torch.bfloat16) for n in (10, 50, 90))
    buf, rest = take_buffer([small, big, bigger], 40)  # list.remove(big) compared small == big: size mismatch
    assert buf is big and len(rest) == 2 and rest[0] is small and rest[1] is bigger
    assert take_buffer([small], 11) == (None, [small])

    class Unpinned(ShardPrefetcher):  # this machine has no pinned-memory allocator (no GPU); the pool is the same
        def _alloc(self, n):
            return torch.empty(n, dtype=torch.bfloat16)

    st = Store.open(store)
    tokens = {sid: int(st.commit_record(sid)["num_tokens"]) for sid in st.committed_ids()}
    by_size = sorted(tokens, key=tokens.get)
    assert len(set(tokens.values())) >= 3
    order = [by_size[0], *reversed(by_size[1:])]  # a small buffer in the pool, then larger shards that need others
    pf = Unpinned(st, order, capacity=2, skip_corrupt=False, pin=True)
    try:
        for sid in order:
            got = pf.get(sid)
            want = st.read_shard(sid)
            assert torch.equal(got.features.float(), want.features.float())
            pf.release(sid)
    finally:
        pf.close()
