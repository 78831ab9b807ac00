"""--dtype auto: bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere; the reason logged, bf16's measured cost
warned, the resolved dtype recorded, and a resumed run keeping its own."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dflash.config import EvalConfig, ExtractConfig, GenerateConfig, TrainConfig
from dflash.errors import ConfigError, ManifestMismatch
from dflash.targets.numerics import (CAPABILITY_ENV, Capability, bf16_cost, capability_from, choose_dtype, cpu_capability,
                             resolve_dtype)

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals

AVX2, AVX512, AMX = Capability("AVX2"), Capability("AVX512"), Capability("AMX_BF16")
AVX512_BF16, ARM = Capability("AVX512_BF16"), Capability("ARM_BF16")


@pytest.mark.parametrize("device, capability, requested, dtype, slow, says", [
    ("cpu", AVX2, "auto", "float32", False, "this CPU has no native bf16 (AVX2)"),
    ("cpu", AVX512, "auto", "float32", False, "this CPU has no native bf16 (AVX512)"),
    ("cpu", AMX, "auto", "bfloat16", False, "this CPU has native bf16 (AMX_BF16)"),
    ("cpu", AVX512_BF16, "auto", "bfloat16", False, "this CPU has native bf16 (AVX512_BF16)"),
    ("cpu", ARM, "auto", "bfloat16", False, "this CPU has native bf16 (ARM_BF16)"),
    ("cpu", AVX2, "bfloat16", "bfloat16", True, "asked for with --dtype bfloat16, though this CPU has no native"),
    ("cpu", AMX, "bfloat16", "bfloat16", False, "asked for with --dtype bfloat16"),
    ("cpu", AVX2, "float32", "float32", False, "asked for with --dtype float32"),
    ("cpu", AMX, "float32", "float32", False, "asked for with --dtype float32"),
    ("cuda", None, "auto", "bfloat16", False, "CUDA runs bf16 natively"),
    ("cuda:3", None, "auto", "bfloat16", False, "CUDA runs bf16 natively"),
    ("cuda", None, "float32", "float32", False, "asked for with --dtype float32"),
    ("cuda", None, "bfloat16", "bfloat16", False, "asked for with --dtype bfloat16"),
])
def test_the_dtype_of_each_device_capability_and_request(device, capability, requested, dtype, slow, says):
    choice = choose_dtype(requested, device, capability)
    assert (choice.dtype, choice.slow_bf16) == (dtype, slow)
    assert says in choice.reason and choice.line == f"dtype {dtype}: {choice.reason}"


@pytest.mark.parametrize("capability, auto, prefer, dtype, slow", [
    (AVX2, "bfloat16", None, "bfloat16", True),  # a resumed bf16 run keeps bf16 on an AVX2 CPU, warned
    (AMX, "float32", None, "float32", False),  # generate's float32 on a CPU, native bf16 or not
    (AVX2, None, "bfloat16", "float32", False),  # eval prefers the run's bf16 only where it is native
    (AMX, None, "bfloat16", "bfloat16", False),
    (AMX, None, "float32", "float32", False),
])
def test_a_callers_auto_overrides_the_hardware_rule(capability, auto, prefer, dtype, slow):
    choice = choose_dtype("auto", "cpu", capability, auto=auto, prefer=prefer, auto_reason="the run trained in it")
    assert (choice.dtype, choice.slow_bf16) == (dtype, slow)
    assert ("the run trained in it" in choice.reason) == (auto is not None or dtype == prefer)
    # An explicit request still wins over a caller's auto.
    assert choose_dtype("float32", "cpu", capability, auto=auto, prefer=prefer).dtype == "float32"


@pytest.mark.parametrize("torch_cap, flags, isa, machine, name, native", [
    ("AVX2", {"avx2", "fma"}, None, "x86_64", "AVX2", False),
    ("AVX512", {"avx512f", "avx512bw"}, None, "x86_64", "AVX512", False),
    ("AVX512", {"avx512f", "avx512_bf16"}, None, "x86_64", "AVX512_BF16", True),
    ("AVX512", {"avx512f", "avx512_bf16", "amx_bf16"}, None, "x86_64", "AMX_BF16", True),  # torch says AVX512
    ("AVX512", {"avx512_bf16", "amx_bf16"}, "AVX512_CORE_BF16", "x86_64", "AVX512_BF16", True),
    ("AVX512", {"avx512_bf16", "amx_bf16"}, "avx512_core_amx", "x86_64", "AMX_BF16", True),  # old alias, any case
    ("AVX512", {"avx512_bf16", "amx_bf16"}, "AVX512_CORE", "x86_64", "AVX512", False),
    ("AVX2", {"avx512_bf16", "amx_bf16"}, "AVX2", "x86_64", "AVX2", False),  # the AVX2 machine, reproduced
    ("AVX512", {"avx512_bf16", "amx_bf16"}, "DEFAULT", "x86_64", "AMX_BF16", True),
    ("DEFAULT", {"fp", "asimd", "bf16"}, None, "aarch64", "ARM_BF16", True),
    ("DEFAULT", {"fp", "asimd"}, None, "aarch64", "DEFAULT", False),
])
def test_the_capability_comes_from_torch_the_cpu_flags_and_onednn(torch_cap, flags, isa, machine, name, native):
    cap = capability_from(torch_cap, frozenset(flags), isa, machine)
    assert (cap.name, cap.native_bf16) == (name, native)
    if isa in ("AVX2", "AVX512_CORE"):  # the log says why a CPU with bf16 instructions gets none
        assert f"ONEDNN_MAX_CPU_ISA={isa} holds oneDNN below the CPU's AMX_BF16" in str(cap)


def test_the_capability_can_be_forced_and_a_wrong_name_is_refused():
    assert cpu_capability({CAPABILITY_ENV: "avx2"}) == Capability("AVX2", f"from {CAPABILITY_ENV}")
    assert cpu_capability({CAPABILITY_ENV: "AMX_BF16"}).native_bf16
    with pytest.raises(ConfigError, match=f"{CAPABILITY_ENV}='AMX' is not a CPU capability.*AMX_BF16"):
        cpu_capability({CAPABILITY_ENV: "AMX"})
    assert cpu_capability({}).name  # detected: whatever this CPU is


def test_explicit_bfloat16_on_a_cpu_without_native_bf16_warns_with_its_measured_cost(monkeypatch, caplog):
    monkeypatch.setenv(CAPABILITY_ENV, "AVX2")
    caplog.set_level(logging.INFO, logger="dflash.targets.numerics")
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "--dtype auto would pick float32" in warned[0], warned
    bf16, fp32 = bf16_cost()
    assert bf16 > 0 and fp32 > 0 and bf16_cost() == (bf16, fp32)  # measured once per process
    assert f"bf16 matmuls run at {bf16:.1f} GFLOP/s on this CPU against {fp32:.0f} in fp32" in warned[0]
    caplog.clear()
    assert resolve_dtype("auto", "cpu") == "float32"
    assert [r.getMessage() for r in caplog.records] == [
        f"dtype float32: this CPU has no native bf16 (AVX2, from {CAPABILITY_ENV})"]


def test_generate_keeps_float32_on_a_cpu_and_warns_for_bfloat16_there(tiny_qwen3, monkeypatch, caplog, tmp_path):
    from dflash.generate.model import resolve

    caplog.set_level(logging.INFO, logger="dflash.targets.numerics")
    monkeypatch.setenv(CAPABILITY_ENV, "AMX_BF16")  # native bf16 changes nothing: decoding verifies in float32
    made = dict(model=str(tiny_qwen3), prompts="p.jsonl", out=str(tmp_path / "o.jsonl"))
    assert resolve(GenerateConfig(**made)).dtype == "float32"
    assert "dtype float32: generate's auto on a CPU" in caplog.text
    monkeypatch.setenv(CAPABILITY_ENV, "AVX2")
    assert resolve(GenerateConfig(**made, dtype="bfloat16")).dtype == "bfloat16"
    assert "GFLOP/s on this CPU" in caplog.text


ROWS = 8


@pytest.fixture(scope="module")
def store(tiny_qwen3, tmp_path_factory) -> str:
    """A store of 2 shards extracted with --dtype auto on a CPU forced to AVX2 (so: in float32)."""
    from dflash.extract import run

    data = tmp_path_factory.mktemp("numerics-data") / "toy.jsonl"
    with open(data, "w") as f:
        for i in range(ROWS):
            answer = " ".join(["one two three four five six seven eight"] * (2 + i % 3))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"count {i}"},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    out = tmp_path_factory.mktemp("numerics-store") / "store"
    cfg = ExtractConfig(model=str(tiny_qwen3), data=(str(data),), out=str(out), gpus="cpu", shard_size=ROWS // 2,
                        batch_tokens=1024, max_length=256, min_loss_tokens=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CAPABILITY_ENV, "AVX2")
        run(cfg)
        mp.setenv(CAPABILITY_ENV, "AMX_BF16")
        run(cfg)  # a rerun keeps the store's float32 where auto would now pick bf16 (no header mismatch)
    return str(out)


def test_extract_records_the_resolved_dtype(store):
    from dflash.storage import Store

    assert Store.open(store).header["compute_dtype"] == "float32"


def train_opts(store: str, target: Path, out: Path, **over) -> dict:
    return {**dict(store=store, target=str(target), out=str(out), gpus="cpu", epochs=10, max_steps=2,
                   batch_tokens=256, draft_layers=1, block_size=4, anchors=8, val_fraction=0.0, log_every=1,
                   save_every=1), **over}


def flags(kw: dict) -> list[str]:
    return [x for k, v in kw.items() for x in ("--" + k.replace("_", "-"), str(v))]


def test_train_auto_is_float32_on_an_avx2_cpu(store, tiny_qwen3, tmp_path, monkeypatch, capsys):
    from test_train_run import dflash_main

    run = tmp_path / "run"
    monkeypatch.setenv(CAPABILITY_ENV, "AVX2")
    code, _, err = dflash_main(capsys, "train", *flags(train_opts(store, tiny_qwen3, run)))  # the CLI, in-process
    assert code == 0, err[-3000:]
    assert f"dtype float32: this CPU has no native bf16 (AVX2, from {CAPABILITY_ENV})" in err
    assert "GFLOP/s" not in err  # nothing to warn about: fp32 is what this CPU runs fast
    record = json.loads((run / "config.json").read_text())
    assert record["config"]["dtype"] == "float32"


def test_train_auto_is_bf16_with_native_bf16_and_a_resume_keeps_the_runs_dtype(store, tiny_qwen3, tmp_path,
                                                                               monkeypatch, caplog):
    from dflash import train as stage
    from dflash.train.evaluate import run_eval
    from dflash.train.metrics import read_metrics

    caplog.set_level(logging.INFO, logger="dflash.targets.numerics")
    run = tmp_path / "run"
    monkeypatch.setenv(CAPABILITY_ENV, "AVX512_BF16")
    stage.run(TrainConfig(**train_opts(store, tiny_qwen3, run)))
    assert f"dtype bfloat16: this CPU has native bf16 (AVX512_BF16, from {CAPABILITY_ENV})" in caplog.text
    record = json.loads((run / "config.json").read_text())
    assert record["config"]["dtype"] == "bfloat16"
    # Resumed where auto would pick float32, the run keeps its bf16 (not refused), and says what that costs.
    caplog.clear()
    monkeypatch.setenv(CAPABILITY_ENV, "AVX2")
    stage.run(TrainConfig(**train_opts(store, tiny_qwen3, run, max_steps=3, resume=True)))
    assert "dtype bfloat16: the run being resumed" in caplog.text and "GFLOP/s on this CPU" in caplog.text
    assert json.loads((run / "config.json").read_text())["config"]["dtype"] == "bfloat16"
    assert [r["step"] for r in read_metrics(run) if r.get("split") == "train"] == [1, 2, 3]
    # An explicit other dtype is a changed option, refused by name.
    with pytest.raises(ManifestMismatch, match='config.dtype: run has "bfloat16", now "float32"'):
        stage.run(TrainConfig(**train_opts(store, tiny_qwen3, run, max_steps=4, resume=True, dtype="float32")))
    # eval's auto takes the run's bf16 where it is native, float32 where it would be emulated.
    assert run_eval(EvalConfig(drafter=str(run), store=store, shards="all"))["dtype"] == "float32"
    monkeypatch.setenv(CAPABILITY_ENV, "AMX_BF16")
    assert run_eval(EvalConfig(drafter=str(run), store=store, shards="all"))["dtype"] == "bfloat16"
