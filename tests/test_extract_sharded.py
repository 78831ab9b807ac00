"""Targets larger than a GPU: the target's weights sharded over ranks (FSDP2, gloo on the CPU, real torchrun
processes) or held by one rank as if in host memory make the same store as one whole copy, sample for sample and
bit for bit; ranks with fewer rows step with empty forwards; a rank SIGKILLed ends its peers with one line each and
the same command resumes; two "nodes" of two ranks share one --out."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash.errors import ConfigError, InputError
from dflash.extract import run
from dflash.extract.placement import SHARDED_BATCH_TOKENS, TargetSize, decide
from test_extract_run import extract_config, one_torch_thread, store_samples, write_conversations  # noqa: F401


def _fsdp_loading() -> bool:
    """Return True if this transformers loads a model sharded by FSDP2 (DistributedConfig with fsdp_plan, 5.25)."""
    from dflash.targets.sharded import _distributed_config

    try:
        _distributed_config()
    except InputError:
        return False
    return True


# Sharded loading is transformers' own (5.25 and later); on an older one --shard-weights refuses in one line.
needs_fsdp_loading = pytest.mark.skipif(not _fsdp_loading(), reason="this transformers has no FSDP2 sharded loading")

_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
GB = 10**9


# --- the decision (pure) -----------------------------------------------------------------------------------------

SIZE_70B = TargetSize(params=140 * GB, embed=2 * GB, layer=2 * GB, token_activation=200_000, captured_layers=5,
                      feature_token=80_000)


@pytest.mark.parametrize("params, free, local, world, want", [
    (16 * GB, 140 * GB, 8, 8, (1, False)),  # fits: today's path
    (140 * GB, 140 * GB, 8, 8, (2, False)),  # the fewest GPUs of a node that hold it
    (560 * GB, 140 * GB, 8, 8, (8, False)),
    (560 * GB, 140 * GB, 4, 8, (8, False)),  # a node's 4 GPUs are too few: two whole nodes
    (700 * GB, 140 * GB, 1, 1, (1, True)),  # one GPU: streamed from host memory
    (1400 * GB, 140 * GB, 8, 8, (8, True)),  # more than the node's GPUs: host memory, one copy a node
])
def test_auto_takes_the_fewest_gpus_that_hold_the_weights(params, free, local, world, want):
    size = TargetSize(params=params, embed=2 * GB, layer=params // 80, token_activation=200_000, captured_layers=5,
                      feature_token=80_000)
    p = decide(None, False, size, free=free, host_free=2000 * GB, local_world=local, world=world, batch_tokens=None,
               on_gpu=True)
    assert (p.shard, p.offload) == want
    assert p.batch_tokens == (SHARDED_BATCH_TOKENS if p.sharded else 32768)
    assert p.reason.startswith("auto: the target's weights are") and p.line().startswith("weights: ")


def test_asked_placements_and_refusals():
    p = decide(4, True, SIZE_70B, free=None, host_free=None, local_world=4, world=8, batch_tokens=8192, on_gpu=True)
    assert (p.shard, p.offload, p.batch_tokens) == (4, True, 8192) and "asked" in p.reason
    on_cpu = decide(None, False, SIZE_70B, free=None, host_free=None, local_world=1, world=1, batch_tokens=None,
                    on_gpu=False)
    assert (on_cpu.shard, on_cpu.offload, on_cpu.batch_tokens) == (1, False, 32768)
    uncounted = decide(None, False, TargetSize(0, 0, 0, 0, 0, 0), free=None, host_free=None, local_world=1, world=1,
                       batch_tokens=None, on_gpu=False)
    assert uncounted.reason == "auto: the target runs on the CPU, whose memory holds it whole", \
        "a size not counted is not said to be 0 B"
    with pytest.raises(ConfigError, match="--shard-weights 3: expected a number of ranks that divides the run's 8"):
        decide(3, False, SIZE_70B, free=None, host_free=None, local_world=8, world=8, batch_tokens=None, on_gpu=True)
    with pytest.raises(InputError, match="^--model m: .* more than this node's 100.00 GB of available host memory"):
        decide(None, False, SIZE_70B, free=80 * GB, host_free=100 * GB, local_world=1, world=1, batch_tokens=None,
               on_gpu=True, where="--model m")
    with pytest.raises(InputError, match="a forward needs 24.35 GB of GPU memory .* the GPU has 20.00 GB free"):
        decide(None, False, SIZE_70B, free=20 * GB, host_free=100 * GB, local_world=1, world=1, batch_tokens=None,
               on_gpu=True)
    with pytest.raises(ConfigError, match="--shard-weights 'x': expected auto or a number"):
        extract_config(Path("m"), Path("d"), Path("o"), shard_weights="x")


def test_a_layer_s_bytes_per_flop_count_every_expert_moved_and_top_k_computed():
    from transformers import Qwen3Config, Qwen3MoeConfig

    from dflash.targets.sharded import captured_size

    shape = dict(vocab_size=1000, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64)
    dense = captured_size(Qwen3Config(**shape), 3, "bfloat16")["bytes_per_flop"]
    assert 1.0 <= dense < 1.01, "bf16: 2 bytes a weight, 2 FLOPs a weight a token (norms add a little)"
    moe_cfg = Qwen3MoeConfig(**shape, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4)
    moe = captured_size(moe_cfg, 3, "bfloat16")["bytes_per_flop"]
    experts = 32 * 3 * 256 * 128
    dense_part = 2 * 256 * 256 + 2 * 256 * 128 + 32 * 256  # q, o, k, v and the router
    assert moe == pytest.approx((experts + dense_part) / (experts * 4 / 32 + dense_part), rel=0.01)


H200 = 989.5e12  # dense bf16 FLOP/s (drafter/flops.py)
# A Qwen3-32B-shaped dense layer (0.98 GB, a byte a FLOP in bf16) and a Qwen3-235B-A22B-shaped MoE layer (5 GB, every
# expert moved for 8 of 128 computed: 5.6 bytes a FLOP, as targets.sharded.captured_size counts a tiny one).
DENSE = TargetSize(params=65 * GB, embed=GB, layer=975_000_000, token_activation=235_000, captured_layers=5,
                   feature_token=51_200, bytes_per_flop=1.0)
MOE = TargetSize(params=470 * GB, embed=GB, layer=5 * GB, token_activation=60_000, captured_layers=5,
                 feature_token=40_960, bytes_per_flop=5.6)


@pytest.mark.parametrize("size, link, free, host, want", [
    (DENSE, 50e9, 140 * GB, 125 * GB, 65536),  # a fast link hides a dense layer at the default batch
    (DENSE, 7.3e9, 140 * GB, 125 * GB, 131072),  # a pageable-speed link: twice the batch
    (MOE, 25e9, 140 * GB, 2000 * GB, 262144),  # an MoE layer moves 5.6x the bytes per FLOP
    (MOE, 25e9, 40 * GB, 2000 * GB, 131072),  # as far as the GPU holds the activations (1.5x), and says so
    (MOE, 25e9, 140 * GB, 630 * GB, 131072),  # as far as the host holds the weights and the feature buffers
    (MOE, None, 140 * GB, 2000 * GB, 65536),  # no link measured (the CPU): the default
])
def test_streamed_weights_take_the_batch_whose_compute_hides_a_layer_s_copy(size, link, free, host, want):
    from dflash.extract.placement import STREAM_MARGIN, STREAM_MFU, activation_bytes

    p = decide(1, True, size, free=free, host_free=host, local_world=1, world=1, batch_tokens=None, on_gpu=True,
               link=link, device_flops=H200)
    assert (p.shard, p.offload, p.batch_tokens) == (1, True, want)
    assert size.embed + 2 * size.layer + activation_bytes(size, want) <= 0.85 * free
    if link is None:
        assert "host link" not in p.reason
        return
    need = STREAM_MARGIN * size.bytes_per_flop * H200 * STREAM_MFU / link
    assert f"({link / 1e9:.1f} GB/s measured)" in p.reason
    assert (want >= need) == ("short of" not in p.reason), p.reason
    assert want == 65536 or want / 2 < need, "never more than the copy needs"
    # the same target offloaded by 8 ranks of a node: each copies an eighth of a layer
    shared = decide(None, True, size, free=free, host_free=host, local_world=8, world=8, batch_tokens=None,
                    on_gpu=True, link=link, device_flops=H200)
    assert shared.shard == 8 and shared.batch_tokens <= want
    asked = decide(1, True, size, free=free, host_free=host, local_world=1, world=1, batch_tokens=4096,
                   on_gpu=True, link=link, device_flops=H200)
    assert asked.batch_tokens == 4096, "--batch-tokens asked is kept"


def test_a_copy_a_rank_counts_every_copy_in_the_node_s_host_memory():
    # --shard-weights 1 --offload cpu on 8 GPUs: 8 copies of 65 GB and 8 ranks' feature buffers in one host
    alone = decide(1, True, DENSE, free=140 * GB, host_free=700 * GB, local_world=1, world=1, batch_tokens=None,
                   on_gpu=True, link=7.3e9, device_flops=H200)
    eight = decide(1, True, DENSE, free=140 * GB, host_free=700 * GB, local_world=8, world=8, batch_tokens=None,
                   on_gpu=True, link=7.3e9, device_flops=H200)
    assert (alone.batch_tokens, eight.batch_tokens) == (131072, 65536)
    assert "short of" in eight.reason and "host memory hold" in eight.reason


# --- the real command ----------------------------------------------------------------------------------------------

ARCHS = ("llama", "qwen3_moe", "qwen3_5", "gpt_oss", "deepseek_v3")


class _Lazy(dict):
    """A dict that makes each value the first time it is asked for (a test builds only the targets it runs)."""

    def __init__(self, make) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key):
        self[key] = value = self._make(key)
        return value


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """10 rows: 5 shards of 2 over 2 ranks, so one rank has more rows than the other."""
    return write_conversations(tmp_path_factory.mktemp("sharded") / "conv.jsonl", 10, seed=5)


@pytest.fixture(scope="module")
def long_data(tmp_path_factory) -> Path:
    """40 rows in shards of 1: a run long enough to be killed in the middle."""
    return write_conversations(tmp_path_factory.mktemp("sharded-long") / "conv.jsonl", 40, seed=6)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    from dflash.tests.tiny_targets import build_tiny_target

    root = tmp_path_factory.mktemp("sharded-targets")
    return _Lazy(lambda arch: build_tiny_target(root / arch, arch))


@pytest.fixture(scope="module")
def references(targets, data, long_data, tmp_path_factory) -> dict[tuple[str, str], dict]:
    """{(arch, "short" | "long"): the store made with a whole copy in this process (today's path)}."""

    def make(key: tuple[str, str]) -> dict:
        arch, which = key
        source, rows = (data, 2) if which == "short" else (long_data, 1)
        cfg = extract_config(targets[arch], source, tmp_path_factory.mktemp("ref") / arch, shard_size=rows)
        run(cfg)
        return store_samples(cfg.out)

    return _Lazy(make)


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), "samples lost or added"
    for row, (ids, mask, bits) in want.items():
        assert np.array_equal(got[row][0], ids) and np.array_equal(got[row][1], mask)
        assert np.array_equal(got[row][2], bits), f"row {row}: features differ from the unsharded store"


def _argv(cfg, *extra: str, level: str = "warning") -> list[str]:
    argv = ["--log-level", level, "extract", "--model", cfg.model, "--out", cfg.out, "--gpus", "cpu"]
    for d in cfg.data:
        argv += ["--data", d]
    for opt in ("shard_size", "batch_tokens", "max_length", "min_loss_tokens", "dtype"):
        argv += ["--" + opt.replace("_", "-"), str(getattr(cfg, opt))]
    return argv + list(extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, argv: list[str], *, nnodes: int = 1, node_rank: int = 0, port: int | None = None
             ) -> subprocess.Popen:
    """Start `torchrun ... -m dflash.cli <argv>` (one node standalone, or one node of a c10d rendezvous)."""
    launch = ["--standalone"] if nnodes == 1 else [
        "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dflash-test"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node", str(nproc),
           "-m", "dflash.cli", *argv]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_ENV,
                            start_new_session=True)


def _finish(p: subprocess.Popen) -> str:
    try:
        err = p.communicate(timeout=600)[1]  # a guard against a hang, not a measurement
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    assert p.returncode == 0, err[-4000:]
    return err


@pytest.mark.internals
@pytest.mark.parametrize("arch", ARCHS)
def test_world_of_one_with_host_offload_equals_a_whole_copy(arch, targets, data, references, tmp_path, capsys):
    # One rank, its decoder layers streamed from host memory a layer ahead (on a CPU, host to host): the same store,
    # on any transformers (no FSDP2 loading is needed for a rank's own copy).
    cfg = extract_config(targets[arch], data, tmp_path / "store", shard_size=2, shard_weights="1", offload="cpu")
    streamed = run(cfg)["devices"][0]["perf"]["weights_streamed"]
    _assert_same(store_samples(cfg.out), references[arch, "short"])
    assert streamed["copies"] > 0 and streamed["out_of_order"] <= 2, streamed  # the first, and the self-check's cut
    assert "weights streamed from host memory at" in capsys.readouterr().err  # the summary
    dry = extract_config(targets[arch], data, tmp_path / "dry", shard_size=2, shard_weights="1", offload="cpu",
                         dry_run=True, batch_tokens=None, max_length=256)
    capsys.readouterr()
    result = run(dry)
    printed = capsys.readouterr().out
    assert "weights: the target's weights on one rank, held in pinned host memory, batches of 65,536 tokens" in printed
    assert "samples packed as if a forward held at least 16,384 tokens, since the weights cross once a forward" \
        in printed
    assert result["plan"]["placement"]["offload"] and result["plan"]["tokens_per_s"] > 0


@pytest.mark.internals
def test_a_streamed_or_sharded_load_takes_no_hub_kernels_unless_asked(targets, monkeypatch):
    # transformers 5.25 swaps Hub kernels into from_pretrained's model by default (downloads, other numerics): the
    # resident load turns that off, and so does load_sharded (one kwargs for the streamed and the FSDP2 load).
    import torch

    from dflash.targets import sharded

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    sharded.init_group(torch.device("cpu"), 60)
    try:
        model = sharded.load_sharded(targets["llama"], torch.device("cpu"), "float32", 1, True)
    finally:
        sharded.release_group()
    assert not getattr(model, "use_kernels", False)


@pytest.mark.slow
def test_two_ranks_each_streaming_its_own_copy_equal_a_whole_copy(targets, data, references, tmp_path):
    # --shard-weights 1 --offload cpu under torchrun: no FSDP2, each rank streams its own copy, in lockstep (uneven
    # rows: one rank steps with empty forwards).
    cfg = extract_config(targets["qwen3_moe"], data, tmp_path / "store", shard_size=2)
    err = _finish(torchrun(2, _argv(cfg, "--shard-weights", "1", "--offload", "cpu", level="info")))
    _assert_same(store_samples(cfg.out), references["qwen3_moe", "short"])
    assert err.count("streamed to cpu a layer ahead") == 2, err[-3000:]  # each rank's own stream


@pytest.mark.internals  # transformers' FSDP2 loading (DistributedConfig) and torch's FSDP2
@needs_fsdp_loading
def test_two_ranks_sharing_one_copy_equal_a_whole_copy(targets, data, references, tmp_path):
    # 5 shards over 2 ranks: uneven rows, so one rank steps with empty forwards while the other finishes.
    from safetensors import safe_open

    cfg = extract_config(targets["llama"], data, tmp_path / "store", shard_size=2)
    err = _finish(torchrun(2, _argv(cfg, "--shard-weights", "2", level="info")))
    # Rank 0's summary gives the whole run's rate from the store, beside its own device's line.
    whole = re.search(r"all 2 ranks: (\d+) shards, ([\d,]+) tokens committed in [\d.]+ s, [\d,]+ tok/s to disk", err)
    stored = store_samples(cfg.out)
    # (a peer's last commit may land just after rank 0 sums them: at most all of them)
    assert whole and 0 < int(whole.group(2).replace(",", "")) <= sum(len(v[0]) for v in stored.values()), err[-3000:]
    _assert_same(stored, references["llama", "short"])
    # Each rank holds its half of the weights, never the whole: together exactly one copy.
    with safe_open(str(targets["llama"] / "model.safetensors"), "pt") as f:
        total = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()) * 4  # fp32
    held = [int(b) for b in re.findall(r"this rank holds (\d+) bytes of weights", err)]
    assert len(held) == 2 and sum(held) == total and max(held) < 0.6 * total, (held, total)


@needs_fsdp_loading
@pytest.mark.slow
@pytest.mark.parametrize("arch, extra", [
    ("qwen3_moe", ()), ("qwen3_5", ("--offload", "cpu")), ("gpt_oss", ()), ("deepseek_v3", ("--offload", "cpu")),
])
def test_every_kind_sharded_over_two_ranks_equals_a_whole_copy(arch, extra, targets, data, references, tmp_path):
    cfg = extract_config(targets[arch], data, tmp_path / "store", shard_size=2)
    _finish(torchrun(2, _argv(cfg, "--shard-weights", "2", *extra)))
    _assert_same(store_samples(cfg.out), references[arch, "short"])


@needs_fsdp_loading
@pytest.mark.slow
def test_two_nodes_of_two_ranks_share_one_out(targets, data, references, tmp_path):
    # Two torchrun agents on one machine, as two nodes of a c10d rendezvous: 4 ranks, one copy a node.
    cfg = extract_config(targets["qwen3_moe"], data, tmp_path / "store", shard_size=2)
    port = _free_port()
    nodes = [torchrun(2, _argv(cfg, "--shard-weights", "2"), nnodes=2, node_rank=i, port=port) for i in range(2)]
    for p in nodes:
        _finish(p)
    _assert_same(store_samples(cfg.out), references["qwen3_moe", "short"])


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _rank_pid(agent: int, rank: int, deadline: float) -> int:
    """Return the pid of the worker of `rank` that a torchrun agent started."""
    while time.monotonic() < deadline:
        for child in _children(agent):
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return child
        time.sleep(0.05)
    raise AssertionError(f"torchrun started no rank {rank}")


@needs_fsdp_loading
def test_a_rank_killed_ends_its_peer_with_one_line_and_the_same_command_resumes(targets, long_data, references,
                                                                                tmp_path):
    cfg = extract_config(targets["llama"], long_data, tmp_path / "store", shard_size=1)
    argv = _argv(cfg, "--shard-weights", "2", "--collective-timeout", "60")
    p = torchrun(2, argv)
    deadline = time.monotonic() + 300
    victim = _rank_pid(p.pid, 1, deadline)
    commits = Path(cfg.out) / "commits"
    while not (commits.is_dir() and any(commits.glob("*.json"))):
        assert p.poll() is None and time.monotonic() < deadline, "the sharded run made no progress"
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    err = p.communicate(timeout=300)[1]  # a guard against a hang
    assert p.returncode != 0
    said = [line for line in err.splitlines() if line.startswith("dflash: ")]
    assert len(said) == 1, err[-4000:]  # the survivor's one line (the victim said nothing: it was killed)
    assert said[0].startswith(("dflash: error: rank 0 of 2", "dflash: interrupted")), said
    _finish(torchrun(2, argv))  # the same command again resumes and completes
    _assert_same(store_samples(cfg.out), references["llama", "long"])


@needs_fsdp_loading
@pytest.mark.slow
def test_spawned_workers_of_one_command_share_one_copy(targets, data, references, tmp_path, monkeypatch):
    # `--gpus 0,1` without a launcher: the command spawns one worker per device, here two CPU "devices", as one
    # process group (dflash's launcher with torchrun's environment).
    from transformers import AutoConfig, AutoTokenizer

    from dflash.conversations import read_rows
    from dflash.extract.header import build_header
    from dflash.extract.orchestrate import _run_spawned
    from dflash.extract.plan import make_plan, scan_rows
    from dflash.extract.progress import Progress
    from dflash.extract.template import load_template
    from dflash.extract.worker import WorkerSpec
    from dflash.storage import Store

    cfg = extract_config(targets["gpt_oss"], data, tmp_path / "store", shard_size=2, shard_weights="2")
    tok = AutoTokenizer.from_pretrained(cfg.model)
    rows = read_rows(cfg.data)
    scan = scan_rows(rows, cfg.max_length)
    header = build_header(cfg, AutoConfig.from_pretrained(cfg.model), tok, load_template(tok, None), scan)
    store = Store.create_or_open(cfg.out, header)
    plan = make_plan(header, rows, scan, (), cfg.out, ["cpu", "cpu"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned interpreters
    results = _run_spawned(cfg, [WorkerSpec("cpu", i, store.header) for i in range(2)], plan, Progress(10, show=False))
    assert sum(r["shards"] for r in results) == store.num_shards
    _assert_same(store_samples(cfg.out), references["gpt_oss", "short"])


@needs_fsdp_loading
@pytest.mark.slow
def test_dry_run_under_torchrun_measures_sharded_on_every_rank(targets, data, tmp_path):
    cfg = extract_config(targets["llama"], data, tmp_path / "store", shard_size=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dflash.cli",
           *_argv(cfg, "--shard-weights", "2", "--dry-run")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_ENV, timeout=600)  # a guard against a hang
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.strip().startswith("weights: ")]
    assert len(lines) == 2 and all("sharded over 2 rank(s), batches of 1,024 tokens (asked" in x for x in lines)
    assert not Path(cfg.out).exists(), "a dry run writes nothing"


@pytest.mark.gpu
def test_host_offload_on_a_gpu_equals_the_resident_target(targets, data, tmp_path):
    # What the CPU cannot show: page-locked host layers copied on a stream of their own while the previous layer
    # runs, each forward waiting on its layer's copy.
    import torch

    want = extract_config(targets["qwen3_moe"], data, tmp_path / "resident", shard_size=2, gpus="0")
    got = extract_config(targets["qwen3_moe"], data, tmp_path / "offloaded", shard_size=2, gpus="0",
                         shard_weights="1", offload="cpu")
    run(want)
    run(got)
    a, b = store_samples(want.out), store_samples(got.out)
    assert sorted(a) == sorted(b)
    for row, (ids, mask, bits) in a.items():
        assert np.array_equal(b[row][0], ids) and np.array_equal(b[row][1], mask)
        x = torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16).float()
        y = torch.from_numpy(b[row][2].astype(np.int16)).view(torch.bfloat16).float()
        assert (x - y).abs().max() <= 1e-2 * x.abs().max(), f"row {row}: offloaded features differ"


def test_a_launched_rank_shows_the_whole_run_from_the_store():
    # Under torchrun rank 0 sees only its own events: the progress it shows counts every rank's committed rows.
    from dflash.extract.progress import Progress

    committed = [0]
    p = Progress(100, show=True, run_rows=lambda: committed[0], world=4)
    p.update({"kind": "batch", "samples": 3, "tokens": 30})
    assert p.display.done == 0
    committed[0] = 40  # peers committed shards
    p.update({"kind": "shard", "bytes": 10})
    assert p.display.done == 40 and p.rows == 3
    p.close()


@pytest.mark.skipif(_fsdp_loading(), reason="this transformers loads sharded models: the tests above run")
def test_a_transformers_without_sharded_loading_is_refused_in_one_line_naming_the_release():
    from dflash.targets.sharded import _distributed_config

    with pytest.raises(InputError, match=r"found transformers 5\.\d+.*pip install 'transformers>=5\.25'"):
        _distributed_config()
