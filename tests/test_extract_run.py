"""`dflash extract` end to end on tiny targets: stored features == the full model's, bad rows, mismatches, ENOSPC."""
from __future__ import annotations

import errno
import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.config import ExtractConfig
from dflash.errors import InputError, ManifestMismatch, StoreError
from dflash.extract import run
from dflash.storage import Store

BAD_ROWS = {3: "malformed_json", 8: "unknown_role", 13: "empty_content"}


def write_conversations(path: Path, n: int, seed: int = 0, bad: dict[int, str] = BAD_ROWS) -> Path:
    """Write n rows of JSONL in the three shapes (short, so a CPU run takes seconds), with bad rows where asked."""
    rng = random.Random(seed)
    words = "the a model token layer block draft target cache shard store verify batch length".split()

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    lines = []
    for i in range(n):
        kind = rng.choice(["messages", "sharegpt", "alpaca"])
        if bad.get(i) == "malformed_json":
            lines.append('{"messages": [{"role": "user"')
            continue
        if bad.get(i) == "unknown_role":
            rec = {"messages": [{"role": "narrator", "content": text(3)}, {"role": "assistant", "content": text(9)}]}
        elif bad.get(i) == "empty_content":
            rec = {"messages": [{"role": "user", "content": text(3)}, {"role": "assistant", "content": ""}]}
        elif kind == "messages":
            rec = {"messages": []}
            for _ in range(rng.randint(1, 2)):
                rec["messages"] += [
                    {"role": "user", "content": text(rng.randint(2, 8))},
                    {"role": "assistant", "content": text(rng.randint(4, 16))},
                ]
        elif kind == "sharegpt":
            rec = {"conversations": [{"from": "human", "value": text(4)}, {"from": "gpt", "value": text(rng.randint(4, 14))}]}
        else:
            rec = {"instruction": text(4), "input": text(rng.randint(0, 3)), "output": text(rng.randint(4, 14))}
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def extract_config(model: Path, data: Path, out: Path, **over) -> ExtractConfig:
    """Return a small CPU config: fp32 (fast and exact on CPU), shards of 4 rows, short samples."""
    opts = dict(
        model=str(model), data=(str(data),), out=str(out), gpus="cpu", shard_size=4, batch_tokens=1024,
        max_length=256, min_loss_tokens=4, dtype="float32",
    )
    opts.update(over)
    return ExtractConfig(**opts)


def store_samples(url: str | Path) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Return {source row: (input_ids, loss_mask, feature bits)} over every committed shard; duplicates fail."""
    store = Store.open(str(url))
    out: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for sid in store.committed_ids():
        d = store.read_shard(sid)
        bits = d.features.view(torch.int16).numpy()
        for k, row in enumerate(d.sample_ids.tolist()):
            a, b = int(d.offsets[k]), int(d.offsets[k + 1])
            assert row not in out, f"row {row} stored twice"
            out[row] = (np.asarray(d.input_ids[a:b]), np.asarray(d.loss_mask[a:b]), bits[a:b].copy())
    return out


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Run torch on one thread: tiny matmuls gain nothing from more, and on a shared 2-core machine OpenMP threads
    that spin against other processes make a run 50x slower. Subprocesses get OMP_NUM_THREADS=1 likewise."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("data") / "conv.jsonl", 18)


@pytest.mark.parametrize(
    "target, dtype, gpus, codec",
    [
        ("tiny_qwen3", "float32", "cpu", "blosc"),
        ("tiny_llama", "bfloat16", "cpu", "blosc"),
        ("tiny_llama", "float32", "cpu", "uq6"),
        pytest.param("tiny_qwen3", "bfloat16", "0", "blosc", marks=pytest.mark.gpu),
        pytest.param("tiny_qwen3", "bfloat16", "0", "uq6", marks=pytest.mark.gpu),
    ],
)
def test_stored_features_equal_the_full_model_on_each_sample(target, dtype, gpus, codec, data_file, tmp_path, request):
    """The lossless store holds the full model's layers within bf16 rounding; the default, uq6, within its
    quantiser's error: steps of 1/6 of a row's median magnitude err by step / sqrt(12) on average, 3.2% of a Gaussian
    row's norm (a random tiny target's rows are about Gaussian; real SmolLM2 rows, heavier-tailed, measured 1.7%)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.conversations import read_rows
    from dflash.extract.template import ChatEncoder

    model_dir = request.getfixturevalue(target)
    cfg = extract_config(model_dir, data_file, tmp_path / "store", dtype=dtype, layers=(1, 4, 6), gpus=gpus,
                         codec=codec)
    device = "cpu" if gpus == "cpu" else "cuda:0"
    summary = run(cfg)
    store = Store.open(cfg.out)
    assert store.is_complete() and store.header["layer_ids"] == [1, 4, 6]
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    full = full.to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    encoder = ChatEncoder(tok, tok.chat_template, cfg.max_length)
    rows = read_rows(cfg.data)
    stored = store_samples(cfg.out)
    assert sorted(stored) == [r.index for r in rows if r.error is None]
    assert summary["samples"] == len(stored) and summary["dropped"] == {v: 1 for v in BAD_ROWS.values()}
    for row, (ids, mask, bits) in stored.items():
        enc = encoder.encode(rows[row].messages)
        assert ids.tolist() == enc.input_ids.tolist() and mask.tolist() == enc.loss_mask.tolist()
        with torch.no_grad():
            x = torch.as_tensor(ids, dtype=torch.long, device=device)[None]
            hs = full(input_ids=x, output_hidden_states=True).hidden_states
        want = torch.stack([hs[i + 1][0] for i in (1, 4, 6)], dim=1).float().cpu()
        got = torch.from_numpy(bits).view(torch.bfloat16).float()
        if codec == "uq6":
            rows_rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
            assert rows_rel.max() < 0.06 and rows_rel.mean() < 0.04, f"row {row}: uq6 error {rows_rel.max():.3g}"
            assert not torch.equal(got, want.to(torch.bfloat16).float()), "uq6 stored exact bf16: not the codec"
        elif dtype == "float32":
            # Batching moves fp32 results by ~1e-6, so each value is at most one bf16 rounding step away.
            assert ((got - want).abs() <= 2.0**-7 * want.abs() + 1e-6).all(), f"row {row}: beyond bf16 rounding"
        else:
            # bf16 compute rounds differently for other batch shapes; the error stays at bf16's relative level.
            rel = (got - want).norm() / want.norm()
            assert rel < 1e-2, f"row {row}: relative error {rel:.3g} is beyond bf16 accumulation"


def _extract_on_and_off(model, data, tmp_path, monkeypatch, codec, gpus, forced):
    """Return the commit records' files of an extract with the pipeline's encode_on_device `forced` (True, or None:
    its default) and of one with it off."""
    from dflash.extract.pipeline import FeaturePipeline
    from dflash.storage.writer import ShardWriter

    encoded: list[bool] = []
    real = ShardWriter.append

    def append(self, *args, scales=None, **kwargs):
        encoded.append(scales is not None)
        return real(self, *args, scales=scales, **kwargs)

    monkeypatch.setattr(ShardWriter, "append", append)
    files, kinds = [], []
    for on in (forced, False):
        monkeypatch.setattr(FeaturePipeline, "encode_on_device", on)
        encoded.clear()
        out = tmp_path / f"{codec}-{on}"
        run(extract_config(model, data, out, codec=codec, gpus=gpus, layers=(1, 4, 6), dtype="bfloat16"))
        store = Store.open(str(out))
        assert store.is_complete()
        files.append({sid: store.commit_record(sid)["files"] for sid in store.committed_ids()})
        kinds.append(set(encoded))
    assert kinds == [{True}, {False}]  # every sample came encoded with the switch on, none with it off
    return files


@pytest.mark.parametrize("codec", ["fp8", "uq6"])
def test_features_encoded_before_the_host_copy_are_the_stores_bytes(codec, tiny_qwen3, data_file, tmp_path,
                                                                    monkeypatch):
    """The pipeline's encode-before-copy path (CUDA's, forced on for the CPU, in slices of a few rows) commits the
    same chunk files (xxh3 in the commit records) as the store's own encoding of bf16 features."""
    from dflash.extract import pipeline

    monkeypatch.setattr(pipeline, "ENCODE_ELEMENTS", 1000)  # slices of 5 rows: the sliced path too
    on, off = _extract_on_and_off(tiny_qwen3, data_file, tmp_path, monkeypatch, codec, "cpu", True)
    assert on == off and sum(len(f) for f in on.values()) > 20


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["fp8", "uq6"])
def test_features_encoded_on_cuda_are_the_stores_bytes(codec, tiny_qwen3, data_file, tmp_path, monkeypatch):
    """On CUDA the pipeline encodes by default (pinned buffers viewed as the codes, a second one for the scales):
    the shards equal those the store encodes from bf16 features, byte for byte."""
    on, off = _extract_on_and_off(tiny_qwen3, data_file, tmp_path, monkeypatch, codec, "0", None)
    assert on == off


def test_bad_rows_reported_with_row_numbers_and_strict_stops(data_file, tiny_qwen3, tmp_path, caplog):
    caplog.set_level("WARNING")
    summary = run(extract_config(tiny_qwen3, data_file, tmp_path / "a"))
    assert summary["dropped_rows"] == {reason: [row] for row, reason in BAD_ROWS.items()}
    assert "row 3 (" in caplog.text and "malformed_json" in caplog.text
    with pytest.raises(InputError, match=r"conv.jsonl:4: bad row \(malformed_json"):
        run(extract_config(tiny_qwen3, data_file, tmp_path / "b", strict=True))


def test_changed_options_are_refused_naming_the_field(data_file, tiny_qwen3, tiny_llama, tmp_path):
    out = tmp_path / "store"
    run(extract_config(tiny_qwen3, data_file, out, shard_size=9))
    with pytest.raises(ManifestMismatch, match="max_length: store has 256, asked for 128"):
        run(extract_config(tiny_qwen3, data_file, out, shard_size=9, max_length=128))
    with pytest.raises(ManifestMismatch, match="layer_ids"):
        run(extract_config(tiny_qwen3, data_file, out, shard_size=9, layers=(1, 2)))
    with pytest.raises(ManifestMismatch, match="codec"):
        run(extract_config(tiny_qwen3, data_file, out, shard_size=9, codec="none"))
    with pytest.raises(ManifestMismatch, match="target.fingerprint"):
        run(extract_config(tiny_llama, data_file, out, shard_size=9))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(ManifestMismatch, match="chat_template_hash"):
        run(extract_config(tiny_qwen3, data_file, out, shard_size=9, chat_template=str(template)))
    other = write_conversations(tmp_path / "other.jsonl", 18, seed=1)
    with pytest.raises(ManifestMismatch, match="dataset.fingerprint"):
        run(extract_config(tiny_qwen3, other, out, shard_size=9))
    # The same options resume (nothing left to do) and report the same totals.
    assert run(extract_config(tiny_qwen3, data_file, out, shard_size=9))["samples"] == 15


def test_gpus_without_cuda_is_an_input_error():
    from dflash.config import resolve_devices as devices_for

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    with pytest.raises(InputError, match="pass --gpus cpu"):
        devices_for("0,1,2,3,4")
    assert devices_for("cpu") == ["cpu"]


def test_vocabulary_without_a_spare_row_needs_mask_token_id(data_file, tmp_path):
    from dflash.tests.tiny_targets import build_tiny_target

    model = build_tiny_target(tmp_path / "full-vocab", "llama", num_layers=4, spare_vocab=0)
    with pytest.raises(InputError, match="pass --mask-token-id"):
        run(extract_config(model, data_file, tmp_path / "s", layers=(1, 2)))
    run(extract_config(model, data_file, tmp_path / "s", layers=(1, 2), mask_token_id=3))
    assert Store.open(str(tmp_path / "s")).header["mask_token_id"] == 3


def test_codec_auto_is_uq6_for_a_new_store_and_a_resumed_stores_own(data_file, tiny_qwen3, tmp_path, caplog):
    """A store made before uq6 became the default (blosc) resumes under the same command, without --codec; asking
    for another codec by name is refused as before."""
    run(extract_config(tiny_qwen3, data_file, tmp_path / "new"))
    assert Store.open(str(tmp_path / "new")).header["codec"] == "uq6"
    cfg = extract_config(tiny_qwen3, data_file, tmp_path / "old", codec="blosc")
    summary = run(cfg)
    from dflash.storage.layout import commit_path

    last = Store.open(cfg.out).committed_ids()[-1]
    (Path(cfg.out) / commit_path(last)).unlink()  # as if killed before its last commit
    with caplog.at_level(logging.INFO, logger="dflash.extract.orchestrate"):
        again = run(extract_config(tiny_qwen3, data_file, tmp_path / "old"))
    assert "codec blosc: the store being resumed" in caplog.text
    assert Store.open(cfg.out).header["codec"] == "blosc" and Store.open(cfg.out).is_complete()
    assert again["samples"] == summary["samples"] == len(store_samples(cfg.out))  # nothing lost or twice
    with pytest.raises(ManifestMismatch, match="codec"):
        run(extract_config(tiny_qwen3, data_file, tmp_path / "old", codec="uq6"))


def test_disk_full_stops_cleanly_and_committed_shards_stay_valid(data_file, tiny_qwen3, tmp_path, monkeypatch):
    from dflash.storage import fs as storage_fs

    real = storage_fs.LocalFS.write_file
    calls = {"n": 0}

    def filling_disk(self, rel, data):
        calls["n"] += 1
        if calls["n"] > 16:  # the disk fills up after a few chunk files
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, rel, data)

    monkeypatch.setattr(storage_fs.LocalFS, "write_file", filling_disk)
    cfg = extract_config(tiny_qwen3, data_file, tmp_path / "store")
    with pytest.raises(StoreError, match="disk full .*rerun the same command to resume"):
        run(cfg)
    store = Store.open(cfg.out)
    done = store.committed_ids()
    assert 0 < len(done) < store.num_shards
    assert all(store.verify(s) == [] for s in done)
    monkeypatch.setattr(storage_fs.LocalFS, "write_file", real)
    run(cfg)
    assert Store.open(cfg.out).is_complete()
    assert len(store_samples(cfg.out)) == 15


def test_replaced_utf8_and_cut_turns_are_counted(tiny_qwen3, tmp_path, capsys):
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "count one two three"}]}
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 100}]}
    lines = [json.dumps(chat).encode(), json.dumps(chat).encode().replace(b"hi", b"h\xff\xfe"), json.dumps(long).encode()]
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    summary = run(extract_config(tiny_qwen3, data, tmp_path / "store", max_length=64))
    assert summary["samples"] == 3
    assert summary["altered"] == {"invalid_utf8_replaced": 1, "truncated_at_max_length": 1}
    assert summary["altered_rows"] == {"invalid_utf8_replaced": [1], "truncated_at_max_length": [2]}
    err = capsys.readouterr().err
    assert "altered 1 rows (invalid_utf8_replaced): rows 1" in err and "(truncated_at_max_length): rows 2" in err
    store = Store.open(str(tmp_path / "store"))
    altered = store.commit_record(0)["extra"]["altered"]
    assert altered["counts"] == {"invalid_utf8_replaced": 1, "truncated_at_max_length": 1}


def test_progress_rates_and_eta_leave_the_start_up_out(monkeypatch, caplog):
    """A run that spent minutes loading and autotuning before its first batch shows the batches' own rate and an ETA
    from it (over the last minute), not one held down by its start-up; a slowdown shows within a minute."""
    import logging
    import types

    from dflash.extract import progress as prog
    from dflash.runtime import process

    clock = [1000.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(prog, "time", fake)
    monkeypatch.setattr(process, "time", fake)
    p = prog.Progress(1000, show=True)
    clock[0] += 300.0  # start-up: the load, the self-check, autotuning
    with caplog.at_level(logging.INFO, logger="dflash.extract.progress"):
        p.update({"kind": "batch", "samples": 10, "tokens": 20_000})
        for _ in range(30):  # then 10 rows and 20,000 tokens every 2 s: 10,000 tok/s, 5 rows/s
            clock[0] += 2.0
            p.update({"kind": "batch", "samples": 10, "tokens": 20_000})
    line = [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()][-1]
    assert "10,000 tok/s, 5.0 samples/s" in line, line
    assert line.endswith("ETA 0:02:18"), line  # 690 rows left at 5 a second
    with caplog.at_level(logging.INFO, logger="dflash.extract.progress"):
        for i in range(40):  # a slowdown to a quarter: 10 rows every 8 s
            clock[0] += 8.0
            p.update({"kind": "batch", "samples": 10, "tokens": 20_000})
            if i == 7:  # 64 s into it the rates are the new pace's alone
                assert prog.window_rate(p._seen) == (1.25, 2_500.0)
    line = [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()][-1]
    assert "2,500 tok/s, 1.2 samples/s" in line and line.endswith("ETA 0:03:52"), line  # 290 rows at 1.25 a second


def test_a_launched_ranks_eta_follows_the_committed_shards_steps(monkeypatch, caplog):
    """Rank 0 of a launched run shows the rows of every rank's committed shards, a count that moves a shard at a
    time (here 500 rows every 150 s, the pace of a large offloaded target): its ETA is timed from commit to commit,
    never '?' once two commits were seen, not a rate of the last minute's 5-s reads."""
    import logging
    import re
    import types

    from dflash.extract import progress as prog
    from dflash.runtime import process

    clock = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(prog, "time", fake)
    monkeypatch.setattr(process, "time", fake)
    monkeypatch.setattr(prog.Display, "__init__", _no_tty(prog.Display.__init__))
    committed = [0]
    p = prog.Progress(10_000, show=True, run_rows=lambda: committed[0], world=4)
    etas = []
    with caplog.at_level(logging.INFO, logger="dflash.extract.progress"):
        for second in range(2, 901, 2):  # a batch every 2 s on this rank, a commit (by some rank) every 150 s
            clock[0] = float(second)
            if second % 150 == 0:
                committed[0] += 500
            p.update({"kind": "batch", "samples": 1, "tokens": 1_000})
            msg = caplog.records[-1].getMessage() if caplog.records else ""
            if second > 300 and "ETA" in msg:
                etas.append(re.search(r"ETA (\S+)$", msg).group(1))
    assert etas and "?" not in etas, etas
    assert etas[-1] == "0:37:30", etas[-5:]  # 7,000 rows left at 500 every 150 s
    p.close()


def _no_tty(init):
    """runtime.Progress as on a run whose stderr is a log file (log lines, no tqdm bar), whatever runs the test."""

    def wrapped(self, *a, **k):
        init(self, *a, **k)
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    return wrapped
