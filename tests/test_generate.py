"""`dflash generate` on the tiny random Qwen3 target: record shape, batched == one-by-one, resume, bad inputs."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.config import GenerateConfig
from dflash.errors import ConfigError, InputError
from dflash.conversations import normalise
from dflash.generate.answer import read_prompts, run

PROMPTS = [
    {"prompt": "hi"},
    {"prompt": "Write a function that adds two numbers, then explain it in one line."},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]},
    {
        "messages": [
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one, please, and say why you picked it."},
        ]
    },
    {"prompt": "Tell me a short story about a fox."},
    "a bare JSON string is a prompt too",
    {"prompt": "ok"},
]


def _write_prompts(path: Path, rows: list) -> Path:
    # A blank line in the middle is not a row: rows are the non-blank lines, numbered from 0.
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _cfg(model: Path, prompts: Path, out: Path, **kw) -> GenerateConfig:
    kw.setdefault("max_new_tokens", 12)
    return GenerateConfig(model=str(model), prompts=str(prompts), out=str(out), **kw)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    return _write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", PROMPTS)


@pytest.fixture(scope="module")
def reference(tiny_qwen3, prompts_file, tmp_path_factory) -> Path:
    """Greedy answers of every prompt, batched by 3 (so batches mix lengths and need left padding)."""
    out = tmp_path_factory.mktemp("ref") / "data.jsonl"
    result = run(_cfg(tiny_qwen3, prompts_file, out, batch_size=3))
    assert (result.answered, result.skipped) == (len(PROMPTS), 0)
    return out


def test_records_are_conversations_ready_for_extract(reference, prompts_file):
    recs = _records(reference)
    prompts = read_prompts(prompts_file)
    assert sorted(r["source_row"] for r in recs) == list(range(len(PROMPTS)))
    for r in recs:
        p = prompts[r["source_row"]]
        assert [m for m in r["messages"] if m["role"] != "assistant"] == p.messages
        assert r["messages"][-1]["role"] == "assistant"
        assert 0 <= r["completion_tokens"] <= 12 * r.get("turns", 1)
        if r.get("turns", 1) == 1:
            assert r["finish_reason"] == ("length" if r["completion_tokens"] == 12 else "stop")
        if r["messages"][-1]["content"].strip():
            # extract's own reader takes the record as one conversation with an assistant turn to train on
            assert normalise(r)[0] == r["messages"]
    assert any(r["completion_tokens"] > 0 for r in recs)
    # System prompts are kept; every assistant turn is the target's, regenerated in order after each user turn.
    two = recs[[r["source_row"] for r in recs].index(3)]
    assert [m["role"] for m in two["messages"]] == ["user", "assistant", "user", "assistant"]
    assert two["messages"][1]["content"] != "Blue." and two["turns"] == 2
    assert recs[[r["source_row"] for r in recs].index(2)]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert (reference.parent / "data.jsonl.config.json").exists()


def _manual_greedy(model_dir: Path, messages: list[dict], max_new: int) -> str:
    """Greedy decoding by hand (full forward each step, argmax), as an independent reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.cat([ids, torch.tensor([new], dtype=ids.dtype)], 1)).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
    return tok.decode(new, skip_special_tokens=True)


def test_greedy_batched_equals_one_by_one(tiny_qwen3, prompts_file, reference, tmp_path):
    out = tmp_path / "one.jsonl"
    run(_cfg(tiny_qwen3, prompts_file, out, batch_size=1))
    by_row = lambda path: {r["source_row"]: r for r in _records(path)}  # noqa: E731
    assert by_row(out) == by_row(reference)
    # A long and a multi-turn prompt, both padded in their batch of 3: each assistant turn is the greedy answer to
    # the regenerated history before it.
    for row, turn in ((1, 1), (3, 1), (3, 3)):
        messages = by_row(reference)[row]["messages"]
        expected = _manual_greedy(tiny_qwen3, messages[:turn], 12)
        assert expected  # a non-empty answer, so the comparison says something
        assert messages[turn]["content"] == expected


def test_resume_after_partial_output_and_torn_last_line(tiny_qwen3, prompts_file, reference, tmp_path):
    ref_lines = reference.read_text(encoding="utf-8").splitlines(keepends=True)
    out = tmp_path / "data.jsonl"
    torn = ref_lines[3][: len(ref_lines[3]) // 2]
    out.write_text("".join(ref_lines[:3]) + torn, encoding="utf-8")
    result = run(_cfg(tiny_qwen3, prompts_file, out, batch_size=2))
    assert (result.skipped, result.answered) == (3, len(PROMPTS) - 3)
    text = out.read_text(encoding="utf-8")
    assert text.startswith("".join(ref_lines[:3]))  # the answered rows were kept, not redone
    recs = _records(out)
    assert sorted(r["source_row"] for r in recs) == list(range(len(PROMPTS)))
    assert {r["source_row"]: r for r in recs} == {r["source_row"]: r for r in _records(reference)}
    again = run(_cfg(tiny_qwen3, prompts_file, out, batch_size=2))
    assert (again.skipped, again.answered) == (len(PROMPTS), 0)
    assert out.read_text(encoding="utf-8") == text


def test_rerun_with_other_answer_options_is_refused(tiny_qwen3, prompts_file, reference):
    with pytest.raises(ConfigError, match="--max-new-tokens 12 but this run has 5"):
        run(_cfg(tiny_qwen3, prompts_file, reference, max_new_tokens=5))


def test_a_record_from_before_the_server_options_still_resumes(tiny_qwen3, prompts_file, reference, tmp_path):
    out = tmp_path / "old.jsonl"
    out.write_bytes(reference.read_bytes())
    saved = json.loads(reference.with_name(reference.name + ".config.json").read_text())
    new = ("server", "served_model", "concurrency", "top_p", "top_k", "sampling_mix", "server_timeout")
    old = {k: v for k, v in saved.items() if k not in new} | {"backend": "transformers"}
    out.with_name(out.name + ".config.json").write_text(json.dumps(old))
    assert run(_cfg(tiny_qwen3, prompts_file, out)).skipped == len(PROMPTS)


def test_sampling_is_seeded(tiny_qwen3, tmp_path):
    prompts = _write_prompts(tmp_path / "p.jsonl", PROMPTS[:3])
    answers = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        out = tmp_path / f"{name}.jsonl"
        run(_cfg(tiny_qwen3, prompts, out, temperature=1.0, seed=seed, max_new_tokens=8))
        answers.append([r["messages"][-1]["content"] for r in _records(out)])
    assert answers[0] == answers[1]
    assert answers[0] != answers[2]


def test_plain_text_prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second prompt  \nthird\n", encoding="utf-8")
    prompts = read_prompts(path)
    assert [(p.row, p.where, p.messages[0]["content"]) for p in prompts] == [
        (0, f"{path}:1", "first prompt"),
        (1, f"{path}:3", "second prompt"),
        (2, f"{path}:4", "third"),
    ]


@pytest.mark.parametrize(
    "bad, reason",
    [
        ('{"prompt": "ok"', "malformed_json"),
        ('{"text": "no prompt key"}', "unknown_shape"),
        ('{"prompt": ""}', "empty_content"),
        ('{"messages": [{"role": "assistant", "content": "a"}]}', "no_user_turn"),
        ('{"messages": [{"role": "robot", "content": "q"}]}', "unknown_role"),
        ("[1, 2]", "unknown_shape"),
    ],
)
def test_bad_prompt_rows_are_counted_by_reason_and_named(tmp_path, caplog, bad, reason):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + bad + "\n", encoding="utf-8")
    with caplog.at_level("WARNING"):
        prompts = read_prompts(path)
    assert [p.row for p in prompts] == [0]
    assert f"1 bad prompt rows ({reason}), skipped: row 1 ({path}:3" in caplog.text
    # A file with no usable row at all is one clear error.
    path.write_text(bad + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=rf"--prompts {re.escape(str(path))}: expected at least one row with a "
                                         rf"user turn, found none usable of 1 \({reason}: 1\)"):
        read_prompts(path)


def test_cli_reports_a_prompts_file_with_nothing_usable_in_one_line(tiny_qwen3, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": 3}\n{"prompt": ""}\n', encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.cli", "generate", "--model", str(tiny_qwen3), "--prompts", str(path),
         "--out", str(tmp_path / "o.jsonl")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert f"--prompts {path}: expected at least one row with a user turn, found none usable of 2" in last
    assert "empty_content: 1, non_string_content: 1" in last
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow  # a fresh interpreter importing torch and transformers is most of its time
def test_sigkill_mid_run_then_rerun_completes(tiny_qwen3, tmp_path):
    import os
    import signal
    import time

    N = 12
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt number {i}: say something about {i * 7}\n" for i in range(N)))
    out = tmp_path / "data.jsonl"
    cmd = [sys.executable, "-m", "dflash.cli", "generate", "--model", str(tiny_qwen3), "--prompts", str(prompts),
           "--out", str(out), "--batch-size", "1", "--max-new-tokens", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and not (out.exists() and out.read_bytes().count(b"\n") >= 2):
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    killed_at = len(_records(out))
    assert 0 < killed_at < N, "the kill must land mid-run for this test to say anything"
    result = run(_cfg(tiny_qwen3, prompts, out, batch_size=1, max_new_tokens=8))
    assert result.skipped >= killed_at - 1 and result.skipped + result.answered == N
    recs = _records(out)
    assert sorted(r["source_row"] for r in recs) == list(range(N))
    ref = tmp_path / "ref.jsonl"
    run(_cfg(tiny_qwen3, prompts, ref, batch_size=N, max_new_tokens=8))
    assert {r["source_row"]: r for r in recs} == {r["source_row"]: r for r in _records(ref)}


def test_a_tokenizer_without_pad_token_still_batches(tiny_qwen3, prompts_file, reference, tmp_path):
    # transformers 5.17's GGUF conversion of SmolLM2 names no pad token; left padding then pads with eos.
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    cfg_file = model / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    tok_cfg["pad_token"] = None
    cfg_file.write_text(json.dumps(tok_cfg))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(model).pad_token_id is None
    out = tmp_path / "nopad.jsonl"
    run(_cfg(model, prompts_file, out, batch_size=3))
    texts = lambda path: {r["source_row"]: r["messages"][-1]["content"] for r in _records(path)}  # noqa: E731
    assert texts(out) == texts(reference)
