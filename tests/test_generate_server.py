"""`dflash generate --server` against a real `transformers serve` of the tiny target (started here, on loopback
ports) and a small standard-library server that records what it is sent or answers 500."""
from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dflash.conversations import normalise
from dflash.cli import main
from dflash.config import GenerateConfig, parse_sampling_mix
from dflash.conversations import generated_by
from dflash.errors import ConfigError
from dflash.generate.answer import run
from dflash.generate.remote import pick_entry, sampling

ROWS = [
    {"prompt": "hi"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a color."},
                       {"from": "gpt", "value": "Blue."}, {"from": "human", "value": "Another?"},
                       {"from": "gpt", "value": "Red."}]},
    {"prompt": "Tell me a short story about a fox."},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"},
                  {"role": "user", "content": "Louder."}]},
]
# What both paths must give alike; a served row adds what it was asked with and who answered.
SHARED_KEYS = {"messages", "source_row", "completion_tokens", "finish_reason", "turns"}


# What each real server lists on /v1/models: transformers serve 5.17 lists nothing for a folder (5.24 and later list
# it), and a run against it must name the model.
_LISTED: dict[str, list[str]] = {}
_FOLDER: dict[str, str] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """A `transformers serve` process of one model folder on a loopback port (restartable on the same port)."""

    def __init__(self, folder: Path, log: Path) -> None:
        self.folder, self.log, self.port = folder, log, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # transformers 5.17's /v1/models scans the Hub cache and answers 500 when that folder does not exist.
        hub = self.log.parent / "hub"
        hub.mkdir(exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_CACHE": str(hub)}
        cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve",
               str(self.folder), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as m:
                            _LISTED[self.url] = [d["id"] for d in json.loads(m.read())["data"]]
                        _FOLDER[self.url] = str(self.folder)
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"transformers serve did not come up: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _serving(folder: Path, tmp_path_factory):
    server = Serve(folder, tmp_path_factory.mktemp("serve") / "serve.log")
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def served(tiny_qwen3, tmp_path_factory):
    yield from _serving(tiny_qwen3, tmp_path_factory)


@pytest.fixture(scope="module")
def second(tiny_qwen3, tmp_path_factory):
    """Another server of the same folder: the one a test kills and restarts, and the second of two."""
    yield from _serving(tiny_qwen3, tmp_path_factory)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _records(path: Path) -> dict[int, dict]:
    lines = path.read_bytes().split(b"\n")[:-1]
    recs = [json.loads(line) for line in lines]
    assert len({r["source_row"] for r in recs}) == len(recs), "a row was written twice"
    return {r["source_row"]: r for r in recs}


def _served_cfg(urls: list[str], prompts: Path, out: Path, **kw) -> GenerateConfig:
    kw.setdefault("max_new_tokens", 8)
    bases = [u.rstrip("/").removesuffix("/v1") for u in urls]
    if any(u in _LISTED and not _LISTED[u] for u in bases):
        kw.setdefault("served_model", next(_FOLDER[u] for u in bases if u in _FOLDER))
    return GenerateConfig(model=None, server=tuple(urls), prompts=str(prompts), out=str(out), **kw)


def _local(model: Path, prompts: Path, out: Path) -> dict[int, dict]:
    run(GenerateConfig(model=str(model), prompts=str(prompts), out=str(out), max_new_tokens=8))
    return _records(out)


def _shared(recs: dict[int, dict]) -> dict[int, dict]:
    return {row: {k: v for k, v in r.items() if k in SHARED_KEYS} for row, r in recs.items()}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("prompts") / "p.jsonl", ROWS)


@pytest.fixture(scope="module")
def reference_out(tiny_qwen3, prompts, tmp_path_factory) -> Path:
    """The in-process answers of ROWS, greedy."""
    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    _local(tiny_qwen3, prompts, out)
    return out


@pytest.fixture(scope="module")
def reference(reference_out) -> dict[int, dict]:
    return _records(reference_out)


def test_served_rows_equal_the_in_process_rows(served, tiny_qwen3, prompts, reference, reference_out, tmp_path):
    out = tmp_path / "served.jsonl"
    result = run(_served_cfg([served.url], prompts, out, concurrency=3))
    assert (result.answered, result.skipped) == (len(ROWS), 0)
    recs = _records(out)
    # Greedy: the same answers, token counts, finish reasons and regenerated histories (system prompts kept).
    assert _shared(recs) == reference
    assert recs[2]["turns"] == 2 and recs[2]["messages"][0] == {"role": "system", "content": "Be brief."}
    for rec in recs.values():
        assert normalise(rec)[0] == rec["messages"]  # extract reads it unchanged
        # The model the server says answered (transformers serve 5.17 adds the revision: FOLDER@main).
        assert rec["served_by"]["model"] in (str(tiny_qwen3), f"{tiny_qwen3}@main")
        assert rec["served_by"]["servers"] == [served.url]
        assert rec["sampling"] == {"temperature": 0.0, "max_tokens": 8, "seed": 0}
    saved = json.loads(out.with_name(out.name + ".config.json").read_text())
    assert (saved["server"], saved["served_model"], saved["model"]) == ([served.url], str(tiny_qwen3), None)
    assert generated_by(out)["served_model"] == str(tiny_qwen3)  # what extract's store header records of the file
    # A rerun has nothing left to do; one with another model, or other sampling, is refused.
    assert run(_served_cfg([served.url + "/v1/"], prompts, out)).skipped == len(ROWS)
    with pytest.raises(ConfigError, match=r"--temperature 0.0 but this run has 0.5"):
        run(_served_cfg([served.url], prompts, out, temperature=0.5))
    sidecar = out.with_name(out.name + ".config.json")
    sidecar.write_text(json.dumps({**saved, "served_model": "other-model"}))
    with pytest.raises(ConfigError, match=rf"--served-model other-model but this run has {tiny_qwen3}"):
        run(_served_cfg([served.url], prompts, out))
    # Nor may served answers be mixed into a file the target answered here.
    with pytest.raises(ConfigError, match=rf"--model {tiny_qwen3} but this run has \(none\)"):
        run(_served_cfg([served.url], prompts, reference_out))


def test_server_killed_mid_run_and_restarted_loses_and_repeats_nothing(second, tiny_qwen3, tmp_path):
    n = 10
    prompts = _write(tmp_path / "p.jsonl", [f"prompt number {i}: say something about {i * 7}" for i in range(n)])
    out = tmp_path / "served.jsonl"
    result: list = []
    worker = threading.Thread(target=lambda: result.append(
        run(_served_cfg([second.url], prompts, out, concurrency=1, server_timeout=90))))
    worker.start()
    while worker.is_alive() and not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        time.sleep(0.01)
    second.kill()
    killed_at = out.read_bytes().count(b"\n")
    assert killed_at < n, "the kill must land mid-run for this test to say anything"
    second.start()
    worker.join(timeout=180)
    assert result and result[0].answered == n
    assert _shared(_records(out)) == _local(tiny_qwen3, prompts, tmp_path / "ref.jsonl")


def test_two_servers_share_the_load(served, second, prompts, reference, tmp_path):
    out = tmp_path / "two.jsonl"
    run(_served_cfg([served.url, second.url], prompts, out, concurrency=4))
    recs = _records(out)
    assert _shared(recs) == reference
    assert {u for r in recs.values() for u in r["served_by"]["servers"]} == {served.url, second.url}


class _Fake(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server in a few lines: lists model "fake", records each chat request, and answers it
    with reasoning split off (or 500 when the server's `fail` is set)."""

    def do_GET(self) -> None:
        if self.server.key and self.headers.get("Authorization") != f"Bearer {self.server.key}":
            self._send(401, {"error": "invalid api key"})
            return
        models = [] if self.server.silent else [{"id": "fake", "object": "model"}]
        self._send(200, {"object": "list", "data": models})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if self.server.fail:
            self._send(500, {"error": "out of memory"})
            return
        if any("slow" in m["content"] for m in body["messages"]):
            time.sleep(1.5)  # past the test's --server-timeout 1
        if any("too long" in m["content"] for m in body["messages"]):
            self._send(400, {"error": "This model's maximum context length is 8 tokens"})
            return
        message = {"role": "assistant", "content": "\nan answer", "reasoning_content": "a thought\n"}
        self._send(200, {"model": "fake", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                         "usage": {"completion_tokens": 7}})

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        try:
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError:  # the client gave up waiting (the slow question)
            pass

    def log_message(self, *args) -> None:
        pass


class _FakeServer(http.server.ThreadingHTTPServer):
    # Every request of a test in flight at once: with the default backlog of 5, a refused SYN is retried after 1 s,
    # which the 1 s --server-timeout of a test would count as a timeout.
    request_queue_size = 128


@pytest.fixture
def fake():
    server = _FakeServer(("127.0.0.1", 0), _Fake)
    server.bodies, server.fail, server.key, server.silent = [], False, None, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_server_that_lists_no_model_is_asked_for_the_named_one(fake, prompts, tmp_path, capsys):
    fake.silent = True  # as transformers serve 5.17 of a folder: /v1/models is an empty list
    url = f"http://127.0.0.1:{fake.server_port}"
    line = _one_line(capsys, ["--prompts", str(prompts), "--out", str(tmp_path / "a.jsonl"), "--server", url])
    assert line == (f"dflash: error: --server {url}: expected the served model on /v1/models, found an empty list "
                    "(transformers serve 5.17 lists only models in the Hub cache); pass --served-model NAME, the "
                    "model it serves (for `transformers serve FOLDER`: FOLDER)")
    result = run(_served_cfg([url], prompts, tmp_path / "b.jsonl", served_model="my-model"))
    assert result.answered == len(ROWS) and {b["model"] for b in fake.bodies} == {"my-model"}


def test_sampling_mix_template_kwargs_and_reasoning_reach_the_wire_and_the_rows(fake, tmp_path):
    n = 40
    rows = [f"question {i}" for i in range(n - 1)] + [ROWS[2]]
    prompts = _write(tmp_path / "p.jsonl", rows)
    mix = parse_sampling_mix('[{"weight": 3, "temperature": 0}, {"weight": 1, "temperature": 0.6, "top_p": 0.95, '
                             '"chat_template_kwargs": {"enable_thinking": true}}]')
    cfg = _served_cfg([f"http://127.0.0.1:{fake.server_port}/v1"], prompts, tmp_path / "o.jsonl", seed=3,
                      sampling_mix=mix, top_k=20, chat_template_kwargs={"enable_thinking": False}, concurrency=5)
    run(cfg)
    recs = _records(tmp_path / "o.jsonl")
    assert sorted(recs) == list(range(n))
    by_prompt = {}
    for body in fake.bodies:
        by_prompt.setdefault(next(m["content"] for m in body["messages"] if m["role"] == "user"), []).append(body)
    thinking = 0
    for row, rec in recs.items():
        got = sampling(cfg, row)
        assert rec["sampling"] == {**got, "seed": 3}
        assert got["top_k"] == 20 and got["max_tokens"] == 8
        if got["temperature"] == 0.6:
            assert got["top_p"] == 0.95 and got["chat_template_kwargs"] == {"enable_thinking": True}
            thinking += 1
        else:
            assert "top_p" not in got and got["chat_template_kwargs"] == {"enable_thinking": False}
        first_user = next(m["content"] for m in rec["messages"] if m["role"] == "user")
        for body in by_prompt[first_user]:
            assert {k: body[k] for k in got} == got and body["model"] == "fake"
        # Reasoning comes back apart; the row holds it as the target wrote it, and the next turn is given that.
        assert rec["messages"][-1] == {"role": "assistant", "content": "<think>\na thought\n</think>\n\nan answer"}
        assert rec["completion_tokens"] == 6 * rec.get("turns", 1)  # usage counts the stop token
        assert rec["served_by"] == {"model": "fake", "servers": [f"http://127.0.0.1:{fake.server_port}"]}
    assert 0 < thinking < n / 2
    second_turn = by_prompt["Name a color."][1]["messages"]
    assert [m["role"] for m in second_turn] == ["system", "user", "assistant", "user"]
    assert second_turn[2]["content"] == recs[n - 1]["messages"][2]["content"]
    # Every request has its own seed, the same on a rerun: a function of (--seed, row, turn).
    assert len({b["seed"] for b in fake.bodies}) == len(fake.bodies)


def test_a_rerun_after_a_kill_asks_only_for_the_rows_not_written(fake, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [f"question {i}" for i in range(12)])
    out = tmp_path / "o.jsonl"
    run(_served_cfg([f"http://127.0.0.1:{fake.server_port}"], prompts, out, concurrency=3))
    whole = out.read_bytes()
    lines = whole.split(b"\n")
    out.write_bytes(b"\n".join(lines[:5]) + b"\n" + lines[5][:20])  # what a kill mid-write leaves
    fake.bodies.clear()
    result = run(_served_cfg([f"http://127.0.0.1:{fake.server_port}"], prompts, out, concurrency=3))
    assert (result.skipped, result.answered) == (5, 7) and len(fake.bodies) == 7
    assert out.read_bytes().startswith(b"\n".join(lines[:5]) + b"\n")
    assert _records(out) == {r["source_row"]: r for r in map(json.loads, whole.split(b"\n")[:-1])}


def test_refused_and_timed_out_conversations_are_counted_named_and_retried_by_the_rerun(fake, tmp_path, capsys):
    rows = [f"question {i}" for i in range(8)]
    rows[5], rows[6] = "a prompt far too long", "a slow question"
    prompts = _write(tmp_path / "p.jsonl", rows)
    out = tmp_path / "o.jsonl"
    argv = ["--prompts", str(prompts), "--out", str(out), "--server", f"http://127.0.0.1:{fake.server_port}",
            "--server-timeout", "1"]
    line = _one_line(capsys, argv)
    assert "--server: 2 of 8 conversations failed (" in line and "1 HTTP 400" in line and "1 timeout" in line
    assert "row 5 (" in line and "maximum context length" in line and "row 6 (" in line
    assert "rerun the same command to retry" in line
    assert sorted(_records(out)) == [0, 1, 2, 3, 4, 7]
    fake.bodies.clear()
    _one_line(capsys, argv)  # still failing: asked again, alone
    assert {b["messages"][-1]["content"] for b in fake.bodies} == {"a prompt far too long", "a slow question"}


def test_pick_entry_follows_the_weights_and_depends_on_row_and_seed_alone():
    mix = parse_sampling_mix('[{"weight": 0.75, "temperature": 0}, {"weight": 0.25, "temperature": 1}]')
    picks = [pick_entry(mix, 0, row)["temperature"] for row in range(4000)]
    assert 0.22 < sum(picks) / len(picks) < 0.28
    assert picks == [pick_entry(mix, 0, row)["temperature"] for row in range(4000)]
    assert picks != [pick_entry(mix, 1, row)["temperature"] for row in range(4000)]
    with pytest.raises(ConfigError, match="unknown key"):
        parse_sampling_mix('[{"weight": 1, "temprature": 0}]')
    with pytest.raises(ConfigError, match="applies to --server only"):
        GenerateConfig(model="m", prompts="p", out="o", sampling_mix=mix)


def _one_line(capsys, argv: list[str]) -> str:
    """Return the error line of a `dflash generate` that must fail with one, and nothing else on stderr but logs."""
    with pytest.raises(SystemExit) as e:
        main(["generate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("dflash: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_wrong_url_model_request_or_a_failing_server_is_one_line(served, fake, prompts, tmp_path, capsys,
                                                                   monkeypatch):
    base = ["--prompts", str(prompts), "--max-new-tokens", "4"]
    dead = f"http://127.0.0.1:{_free_port()}"
    line = _one_line(capsys, [*base, "--out", str(tmp_path / "a.jsonl"), "--server", dead, "--server-timeout", "1"])
    assert f"--server {dead}: no answer on {dead}/v1/models for 1 s (connection error" in line
    if _LISTED[served.url]:
        line = _one_line(capsys, [*base, "--out", str(tmp_path / "b.jsonl"), "--server", served.url,
                                  "--served-model", "Qwen/Qwen3-8B"])
        assert f"--served-model Qwen/Qwen3-8B: {served.url} serves ['{served.folder}']" in line
    else:  # transformers 5.17: the server lists nothing, so the model must be named
        line = _one_line(capsys, [*base, "--out", str(tmp_path / "b.jsonl"), "--server", served.url])
        assert f"--server {served.url}: expected the served model on /v1/models, found an empty list" in line
    named = [] if _LISTED[served.url] else ["--served-model", str(served.folder)]
    # A request transformers serve refuses (it takes no top_k): 422, not retried.
    line = _one_line(capsys, [*base, *named, "--out", str(tmp_path / "c.jsonl"), "--server", served.url, "--top-k",
                              "5"])
    assert "the first requests all failed" in line and "answered 422" in line and "top_k" in line
    fake.key = "sk-local"
    line = _one_line(capsys, [*base, "--out", str(tmp_path / "d.jsonl"), "--server",
                              f"http://127.0.0.1:{fake.server_port}"])
    assert "/v1/models answered 401" in line and "set OPENAI_API_KEY to the server's --api-key" in line
    monkeypatch.setenv("OPENAI_API_KEY", "sk-local")
    fake.fail = True
    line = _one_line(capsys, [*base, "--out", str(tmp_path / "e.jsonl"), "--server-timeout", "1", "--server",
                              f"http://127.0.0.1:{fake.server_port}"])
    assert "the first requests all failed" in line and "HTTP 500" in line and "out of memory" in line
    assert len(fake.bodies) > len(ROWS)  # retried before giving up
    for name in "abcde":
        assert not (tmp_path / f"{name}.jsonl").exists()
