"""OpenAI-compatible chat servers as `dflash generate --server` talks to them (vLLM, SGLang, `transformers serve`).

The standard library alone (http.client, one keep-alive connection per thread and server), so the core needs no
HTTP package. A request goes to the servers in turn; timeouts, connection errors, 408/429 and 5xx answers are retried
with backoff on the next server until --server-timeout has passed since the first failure; any other answer is
final. What a user can fix (a wrong URL, a wrong model name, a refused request) becomes one ServerError line.
"""
from __future__ import annotations

import http.client
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import ServerError

__all__ = ["Servers", "Reply", "RequestFailed", "base_url", "answer_text"]

log = logging.getLogger(__name__)

_RETRIED = {408, 429}
_FIRST_BACKOFF_S = 0.25
_MAX_BACKOFF_S = 10.0
_START_HINT = "start it (vllm serve MODEL --port 8000, or transformers serve FOLDER) or fix the URL"


def base_url(url: str) -> str:
    """Return a server's base URL: without a trailing slash or /v1 (http://host:8000/v1/ -> http://host:8000)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def answer_text(message: dict[str, Any]) -> str:
    """Return the assistant's text as the target wrote it: reasoning a server's parser split off (reasoning_content,
    or reasoning in newer vLLM) is put back before the answer in the <think> form that the templates of reasoning
    targets (Qwen3, DeepSeek-R1) render and split again, so extract trains on what serving renders."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if not reasoning:
        return content
    return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"


@dataclass(frozen=True)
class Reply:
    """One answer: its text (reasoning folded in), new tokens, finish reason, and which server and model gave it."""

    text: str
    tokens: int
    finish_reason: str
    server: str
    model: str


class RequestFailed(Exception):
    """A request no server answered: `down` when the servers could not be reached at all (the run cannot go on),
    else an answer that retries did not change (a 4xx, or a 5xx or timeout until --server-timeout)."""

    def __init__(self, reason: str, message: str, *, down: bool = False) -> None:
        super().__init__(message)
        self.reason, self.down = reason, down


class _Retry(Exception):
    """A failure worth another try: a timeout, a lost connection, 408, 429 or 5xx."""

    def __init__(self, reason: str, detail: str, *, down: bool) -> None:
        super().__init__(detail)
        self.reason, self.down = reason, down


class Servers:
    """The servers of a run, spoken to from many threads at once."""

    def __init__(self, urls: tuple[str, ...] | list[str], *, timeout: float) -> None:
        self.urls = [base_url(u) for u in urls]
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        # As OpenAI's own client: a server started with --api-key (vLLM, SGLang) wants it on every request.
        if os.environ.get("OPENAI_API_KEY"):
            self.headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        self._turn = itertools.count()
        self._local = threading.local()

    # -- start-up ----------------------------------------------------------------------------------------------------

    def served_model(self, name: str | None) -> str:
        """Return the model name requests ask for: `name`, checked against what every server lists on /v1/models,
        or the one model they all serve when `name` is None. ServerError when a server is not there or does not
        serve it (waits up to the timeout for a server still coming up)."""
        listed = {url: self._models(url) for url in self.urls}
        # transformers serve 5.17 lists only the Hub cache's models (5.24 lists its folder too), not the folder it was started with: a
        # server that lists nothing cannot be checked, and is asked for --served-model as given.
        silent = [url for url, models in listed.items() if not models]
        checked = {url: models for url, models in listed.items() if models}
        if name is None:
            common = set.intersection(*(set(v) for v in checked.values())) if checked else set()
            if len(common) != 1:
                if not checked:
                    raise ServerError(
                        f"--server {', '.join(silent)}: expected the served model on /v1/models, found an empty "
                        "list (transformers serve 5.17 lists only models in the Hub cache); pass "
                        "--served-model NAME, the model it serves (for `transformers serve FOLDER`: FOLDER)")
                shown = "; ".join(f"{u} serves {sorted(v)}" for u, v in listed.items())
                raise ServerError(f"--server: expected one model served by every server, found {shown}; pass "
                                  "--served-model NAME")
            name = common.pop()
        for url in silent:
            log.info("generate: %s lists no model on /v1/models; asking it for %s unchecked", url, name)
        for url, models in checked.items():
            if name not in models:
                raise ServerError(f"--served-model {name}: {url} serves {sorted(models)}; pass one of them, or leave "
                                  "--served-model out when the servers serve one model")
        return name

    def _models(self, url: str) -> list[str]:
        """Return the model ids one server lists, retrying until it comes up or the timeout passes."""
        deadline = time.monotonic() + self.timeout
        for attempt in itertools.count():
            try:
                status, body = self._send(url, "GET", "/v1/models", None)
            except _Retry as e:
                if time.monotonic() >= deadline:
                    raise ServerError(f"--server {url}: no answer on {url}/v1/models for {self.timeout:g} s "
                                      f"({e.reason}: {e}); {_START_HINT}") from None
                if attempt == 0:
                    log.info("generate: waiting up to %g s for %s to come up (%s)", self.timeout, url, e.reason)
                time.sleep(_backoff(attempt))
                continue
            try:
                if status == 200:
                    return [m["id"] for m in json.loads(body)["data"]]
            except (ValueError, KeyError, TypeError):
                pass
            fix = ("set OPENAI_API_KEY to the server's --api-key" if status == 401 else "pass the base URL of vllm "
                   "serve, SGLang or transformers serve, such as http://host:8000")
            raise ServerError(f"--server {url}: expected the model list of an OpenAI-compatible server, but "
                              f"{url}/v1/models answered {status} {_snippet(body)!r}; {fix}")

    # -- requests ----------------------------------------------------------------------------------------------------

    def chat(self, body: dict[str, Any]) -> Reply:
        """Return the answer to one /v1/chat/completions request, retried with backoff over the servers; raise
        RequestFailed when none answers within the timeout, or a server refuses it."""
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        start = time.monotonic()
        for attempt in itertools.count():
            url = self.urls[next(self._turn) % len(self.urls)]
            try:
                status, raw = self._send(url, "POST", "/v1/chat/completions", data)
            except _Retry as e:
                if time.monotonic() - start >= self.timeout:
                    raise RequestFailed(e.reason, f"{url}: {e.reason} ({e}) on every try for {self.timeout:g} s",
                                        down=e.down) from None
                time.sleep(_backoff(attempt))
                continue
            if status != 200:
                raise RequestFailed(f"HTTP {status}", f"{url}/v1/chat/completions answered {status} "
                                                      f"{_snippet(raw)!r}")
            try:
                reply = json.loads(raw)
                choice = reply["choices"][0]
                finish = str(choice.get("finish_reason"))
                tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
                return Reply(answer_text(choice["message"]), _text_tokens(tokens, finish), finish, url,
                             str(reply.get("model")))
            except (ValueError, KeyError, IndexError, TypeError):
                raise RequestFailed("bad answer", f"{url}/v1/chat/completions answered 200 without a chat "
                                                  f"completion: {_snippet(raw)!r}") from None

    def _send(self, url: str, method: str, path: str, data: bytes | None) -> tuple[int, bytes]:
        """Return (status, body) of one HTTP exchange on this thread's connection to `url`; _Retry on what another
        try may mend (the connection is dropped then, and made anew next time)."""
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(url)
        if conn is None:
            parts = urlsplit(url)
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = conns[url] = cls(parts.netloc, timeout=self.timeout)
        prefix = urlsplit(url).path
        try:
            conn.request(method, prefix + path, body=data, headers=self.headers)
            resp = conn.getresponse()
            status, body = resp.status, resp.read()
        except TimeoutError as e:
            conns.pop(url).close()
            raise _Retry("timeout", str(e) or "no answer", down=False) from None
        except (OSError, http.client.HTTPException) as e:
            conns.pop(url).close()
            raise _Retry("connection error", f"{type(e).__name__}: {e}", down=True) from None
        if status in _RETRIED or status >= 500:
            raise _Retry(f"HTTP {status}", _snippet(body), down=False)
        return status, body


def _text_tokens(completion_tokens: int, finish_reason: str) -> int:
    """Return the tokens of the answer's text, as the in-process path counts them: a server's usage counts the stop
    token too when the answer ended on one (transformers serve: 10 where the same greedy answer in-process had 9)."""
    return max(completion_tokens - 1, 0) if finish_reason == "stop" else completion_tokens


def _backoff(attempt: int) -> float:
    """Return the pause before retry `attempt` (0.25 s doubling to 10 s)."""
    return min(_FIRST_BACKOFF_S * 2**attempt, _MAX_BACKOFF_S)


def _snippet(body: bytes, n: int = 200) -> str:
    """Return the start of a body as one line of text."""
    return " ".join(body[:n].decode("utf-8", "replace").split())
