"""The regeneration recipe on whole conversation files, and the chat-template variables every stage renders with."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.config import GenerateConfig
from dflash.errors import ConfigError, DflashError
from dflash.generate.answer import run as generate
from dflash.tests.tiny_targets import CHATML_TEMPLATE
from test_chatfiles import LINE_LIKE
from test_extract_run import extract_config, one_torch_thread, store_samples  # noqa: F401

CONVS = [
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a color."},
                       {"from": "gpt", "value": "Blue."}, {"from": "human", "value": "Another?"},
                       {"from": "gpt", "value": "Red."}, {"from": "human", "value": ""},
                       {"from": "gpt", "value": "Green."}]},
    {"messages": [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"}]},
    {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": ""},
                       {"from": "human", "value": "Louder."}, {"from": "gpt", "value": "HI"}]},
]


def _records(path: Path) -> dict[int, dict]:
    return {r["source_row"]: r for r in map(json.loads, path.read_bytes().split(b"\n")[:-1])}


def _cfg(model: Path, prompts: Path, out: Path, **kw) -> GenerateConfig:
    kw.setdefault("max_new_tokens", 6)
    return GenerateConfig(model=str(model), prompts=str(prompts), out=str(out), **kw)


def test_every_assistant_turn_is_regenerated_in_order(tiny_qwen3, tmp_path, caplog):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(CONVS))
    out = tmp_path / "regen.jsonl"
    with caplog.at_level("INFO"):
        generate(_cfg(tiny_qwen3, data, out))
    recs = _records(out)
    roles = {row: [m["role"] for m in r["messages"]] for row, r in recs.items()}
    # The system prompt is kept; the empty user turn is skipped (and counted); each user turn gets one answer.
    assert roles == {0: ["system", "user", "assistant", "user", "assistant"], 1: ["user", "assistant"],
                     2: ["user", "assistant", "user", "assistant"]}
    assert recs[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert recs[0]["turns"] == 2 and "turns" not in recs[1]
    assert "2 prompt rows read with empty_turns_skipped" in caplog.text
    # Nothing of the data's assistant text is left, and each answer is the target's to the regenerated history.
    texts = [m["content"] for r in recs.values() for m in r["messages"] if m["role"] == "assistant"]
    assert not {"Blue.", "Red.", "Green.", "1 2 3", "HI"} & set(texts)
    one = tmp_path / "one.jsonl"
    (tmp_path / "h.jsonl").write_text(json.dumps({"messages": recs[0]["messages"][:4]}) + "\n")
    generate(_cfg(tiny_qwen3, tmp_path / "h.jsonl", one))
    assert _records(one)[0]["messages"][-1] == recs[0]["messages"][-1]
    # extract reads the records unchanged, as conversations to train on
    from dflash.extract import run as extract

    summary = extract(extract_config(tiny_qwen3, out, tmp_path / "store"))
    assert summary["samples"] + sum(summary["dropped"].values()) == 3


def test_multi_turn_regeneration_resumes_after_sigkill(tiny_qwen3, tmp_path):
    n = 10
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "x"},
                          {"role": "user", "content": f"and then {i * 3}?"}]} if i % 2 else
            {"prompt": f"single {i}"} for i in range(n)]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dflash.cli", "generate", "--model", str(tiny_qwen3), "--prompts", str(data),
           "--out", str(out), "--batch-size", "1", "--max-new-tokens", "6", "--engine", "plain"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and not (out.exists() and out.read_bytes().count(b"\n") >= 2):
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    killed_at = len(_records(out))
    assert 0 < killed_at < n, "the kill must land mid-run for this test to say anything"
    result = generate(_cfg(tiny_qwen3, data, out, batch_size=1, engine="plain"))
    assert result.skipped + result.answered == n
    ref = tmp_path / "ref.jsonl"
    generate(_cfg(tiny_qwen3, data, ref, batch_size=n, engine="plain"))
    assert _records(out) == _records(ref)
    assert all(_records(ref)[i]["turns"] == 2 for i in range(1, n, 2))


def _template_model(tiny_qwen3: Path, tmp_path: Path) -> Path:
    """Return a copy of the tiny target whose chat template prints the variable `mode` in every header."""
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    template = CHATML_TEMPLATE.replace("message['role'] + '\n'",
                                       "message['role'] + (' mode=' + mode if mode is defined else '') + '\n'")
    for f in model.glob("chat_template*"):
        f.unlink()
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model


def test_chat_template_kwargs_reach_the_ids_and_a_change_is_refused(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    from dflash.extract import run as extract
    from dflash.storage import Store
    from dflash.storage.summary import format_inspect, inspect_store

    model = _template_model(tiny_qwen3, tmp_path)
    tok = AutoTokenizer.from_pretrained(model)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "there"}) + "\n")
    out = tmp_path / "answers.jsonl"
    generate(_cfg(model, data, out, chat_template_kwargs={"mode": "fast"}))
    assert json.loads((tmp_path / "answers.jsonl.config.json").read_text())["chat_template_kwargs"] == {"mode": "fast"}
    with pytest.raises(ConfigError, match=r"--chat-template-kwargs \{'mode': 'fast'\} but this run has"):
        generate(_cfg(model, data, out, chat_template_kwargs={"mode": "slow"}))
    # extract renders with them: the stored ids say mode=fast, and the header records the variables
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q" * 8},
                                                      {"role": "assistant", "content": "a" * 12}]}) + "\n"
                             for _ in range(3)))
    store = tmp_path / "store"
    extract(extract_config(model, convs, store, chat_template_kwargs={"mode": "fast"}))
    ids = store_samples(store)[0][0]
    assert "<|im_start|>user mode=fast\n" in tok.decode(ids.tolist())
    assert Store.open(str(store)).header["chat_template_kwargs"] == {"mode": "fast"}
    assert 'kwargs {"mode": "fast"}' in format_inspect(inspect_store(str(store)))
    with pytest.raises(DflashError, match="chat_template_kwargs"):
        extract(extract_config(model, convs, store, chat_template_kwargs={"mode": "slow"}))
    plain = tmp_path / "plain"
    extract(extract_config(model, convs, plain))
    assert "mode=" not in tok.decode(store_samples(plain)[0][0].tolist())


def test_line_like_characters_round_trip_demo_generate_extract(tiny_qwen3, tmp_path):
    """A prompt holding U+2028, U+2029, U+0085, \\v, \\f and \\x1c-\\x1e, written as the demo writes prompts, is
    answered by generate and extracted unchanged."""
    from transformers import AutoTokenizer

    from dflash.demo.data import prompt_lines, write_lines
    from dflash.extract import run as extract
    from dflash.extract.template import ChatEncoder

    written = tmp_path / "self-prompts.jsonl"  # as `generate --self-prompts` writes them
    written.write_text(json.dumps({"prompt": f"Repeat {LINE_LIKE} please", "draw": 0}, ensure_ascii=False) + "\n"
                       + json.dumps({"prompt": "Say something nice about cats", "draw": 1}) + "\n")
    bundled = tmp_path / "bundled.jsonl"
    bundled.write_text(json.dumps({"prompt": f"bundled {LINE_LIKE}"}, ensure_ascii=False) + "\n")
    first, own = prompt_lines(bundled, 1, written)
    prompts = write_lines(tmp_path / "prompts.jsonl", first + own)
    answers = tmp_path / "answers.jsonl"
    generate(_cfg(tiny_qwen3, prompts, answers, max_new_tokens=4))
    recs = _records(answers)
    assert [recs[i]["messages"][0]["content"] for i in range(3)] == [
        f"bundled {LINE_LIKE}", f"Repeat {LINE_LIKE} please", "Say something nice about cats"]
    store = tmp_path / "store"
    extract(extract_config(tiny_qwen3, answers, store, min_loss_tokens=0))
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    encoder = ChatEncoder(tok, tok.chat_template, 256)
    stored = store_samples(store)
    for row in stored:
        assert stored[row][0].tolist() == encoder.encode(recs[row]["messages"]).input_ids.tolist()
    assert LINE_LIKE in tok.decode(stored[0][0].tolist())
