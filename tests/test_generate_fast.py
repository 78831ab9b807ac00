"""The fast generate engine equals the plain one (fp32 greedy, refilled slots); self-prompts are distinct, finished,
seeded, resumable and respect --exclude."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.config import GenerateConfig
from dflash.errors import ConfigError
from dflash.generate import run
from dflash.generate.prompts import read_prompts
from dflash.generate.self_prompts import MIN_WORDS, normalise

N_PROMPTS = 14


def _records(path: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["source_row"]: r for r in recs}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def eager_target(request, tmp_path_factory) -> Path:
    """A tiny target whose eos is likely, so answers stop at many different lengths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.tests.tiny_targets import build_tiny_target

    path = build_tiny_target(tmp_path_factory.mktemp(f"eager-{request.param}"), request.param)
    model = AutoModelForCausalLM.from_pretrained(path)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    with torch.no_grad():
        model.lm_head.weight[eos] *= 1.6
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("p") / "p.txt"
    path.write_text("".join(f"prompt {i}: " + "more words " * (i * 5 % 13) + "\n" for i in range(N_PROMPTS)))
    return path


def _answer(model: Path, prompts: Path, out: Path, **kw) -> dict[int, dict]:
    kw.setdefault("max_new_tokens", 40)
    run(GenerateConfig(model=str(model), prompts=str(prompts), out=str(out), **kw))
    return _records(out)


def test_fast_greedy_equals_plain_with_refilled_slots(eager_target, prompts, tmp_path):
    plain = _answer(eager_target, prompts, tmp_path / "plain.jsonl", engine="plain", batch_size=N_PROMPTS)
    fast = _answer(eager_target, prompts, tmp_path / "fast.jsonl", engine="fast", batch_size=3)
    assert fast == plain
    lengths = {r["completion_tokens"] for r in fast.values() if r["finish_reason"] == "stop"}
    assert len(lengths) >= 3, "answers must stop at several lengths for the refill to be exercised"
    assert any(r["finish_reason"] == "length" for r in fast.values())
    # The sidecar says in which numerics the answers were made.
    saved = json.loads((tmp_path / "fast.jsonl.config.json").read_text())
    assert (saved["engine"], saved["dtype"], saved["device"]) == ("fast", "float32", "cpu")


@pytest.mark.slow  # bf16 matmuls of the plain engine at batch 1 are slow on a CPU without bf16 units
def test_fast_bf16_agrees_with_plain_until_rounding_decides(eager_target, prompts, tmp_path):
    # bf16 tolerance: the engines' kernels round differently, so an answer may leave the other engine's at the
    # first near-tie of two logits (on this CPU about half of them do, after ~15 tokens); before that they agree.
    # The first token of every answer comes from one forward of the prompt and must be the same.
    plain = _answer(eager_target, prompts, tmp_path / "plain.jsonl", engine="plain", batch_size=1, dtype="bfloat16")
    fast = _answer(eager_target, prompts, tmp_path / "fast.jsonl", engine="fast", batch_size=3, dtype="bfloat16")
    text = lambda r: r["messages"][-1]["content"]  # noqa: E731
    assert all(text(fast[row])[:1] == text(plain[row])[:1] for row in plain)
    assert sum(text(fast[row]) == text(plain[row]) for row in plain) >= len(plain) // 4
    assert json.loads((tmp_path / "fast.jsonl.config.json").read_text())["dtype"] == "bfloat16"


def test_decoder_that_looks_every_few_steps_gives_the_same_tokens(eager_target, prompts):
    # On CUDA the host reads the finished flags every 8 steps (slots run on past their end meanwhile, and the
    # cache columns read are bucketed ahead): the same tokens as looking after every step.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.generate.engine import FastDecoder, Request

    tok = AutoTokenizer.from_pretrained(eager_target)
    model = AutoModelForCausalLM.from_pretrained(eager_target, dtype=torch.float32).eval()
    ids = [tok(p.messages[0]["content"], add_special_tokens=False)["input_ids"] for p in read_prompts(prompts)]
    got = []
    for sync_every in (1, 5):
        dec = FastDecoder(model, slots=4, max_new_tokens=30, stop_ids=[tok.eos_token_id], sync_every=sync_every)
        done = [c for batch in dec.run((Request(i, x) for i, x in enumerate(ids)), max_prompt=max(map(len, ids)))
                for c in batch]
        got.append({c.key: (c.tokens, c.finished) for c in done})
    assert got[0] == got[1] and len(got[0]) == len(ids)
    assert len({len(t) for t, finished in got[0].values() if finished}) >= 2


def test_resume_with_other_numerics_is_refused(eager_target, prompts, tmp_path):
    out = tmp_path / "a.jsonl"
    _answer(eager_target, prompts, out, engine="fast", max_new_tokens=4)
    with pytest.raises(ConfigError, match="--engine fast but this run has plain"):
        _answer(eager_target, prompts, out, engine="plain", max_new_tokens=4)


def _self(model: Path, out: Path, n: int, **kw) -> list[dict]:
    kw.setdefault("batch_size", 8)
    run(GenerateConfig(model=str(model), prompts=None, self_prompts=n, out=str(out), **kw))
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module", autouse=True)
def short_prompts():
    """Prompts of at most 48 tokens: a random tiny target's draws are long, this keeps the tests quick."""
    from dflash.generate import self_prompts

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(self_prompts, "MAX_PROMPT_TOKENS", 48)
        yield


@pytest.fixture(scope="module")
def chatty(tmp_path_factory) -> Path:
    """A tiny Llama target that writes spaces and ends its turn often, so short prompts of several words come."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.tests.tiny_targets import build_tiny_target

    path = build_tiny_target(tmp_path_factory.mktemp("chatty"), "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 1.5
        model.lm_head.weight[tok.convert_tokens_to_ids("Ġ")] *= 2.5  # the byte-level space
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def written(chatty, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sp") / "prompts.jsonl"
    _self(chatty, out, 4, seed=3)
    return out


def test_self_prompts_are_distinct_finished_and_read_as_prompts(written):
    lines = [json.loads(line) for line in written.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 4
    texts = [r["prompt"] for r in lines]
    assert len({normalise(t) for t in texts}) == 4
    assert all(len(t.split()) >= MIN_WORDS for t in texts)
    assert [r["draw"] for r in lines] == sorted(r["draw"] for r in lines)
    # `dflash generate --prompts` reads the file as it is.
    assert [p.messages for p in read_prompts(written)] == [[{"role": "user", "content": t}] for t in texts]


def test_self_prompts_are_seeded_and_a_rerun_continues(chatty, written, tmp_path):
    # Batch 3 instead of 8: the prompts of a seed do not depend on the batch they were drawn in.
    first = _self(chatty, tmp_path / "a.jsonl", 2, seed=3, batch_size=3)
    ref = [json.loads(line) for line in written.read_text(encoding="utf-8").splitlines()]
    assert first == ref[:2]
    # A kill left a torn line: the rerun with a larger N drops it and continues where the first run stopped.
    with open(tmp_path / "a.jsonl", "a", encoding="utf-8") as f:
        f.write('{"prompt": "half a li')
    assert _self(chatty, tmp_path / "a.jsonl", 4, seed=3, batch_size=3) == ref
    other = _self(chatty, tmp_path / "b.jsonl", 2, seed=4)
    assert [r["prompt"] for r in other] != [r["prompt"] for r in ref[:2]]
    with pytest.raises(ConfigError, match="--seed 3 but this run has 4"):
        _self(chatty, tmp_path / "a.jsonl", 5, seed=4)


def test_self_prompts_exclude(chatty, written, tmp_path):
    ref = [json.loads(line)["prompt"] for line in written.read_text(encoding="utf-8").splitlines()]
    exclude = tmp_path / "ex.jsonl"
    upper = "".join(c.upper() if c.isascii() else c for c in ref[0])
    # Compared normalised: another case, other spaces.
    exclude.write_text(json.dumps({"prompt": upper}) + "\n" + json.dumps({"prompt": " " + "  ".join(ref[2].split())}) + "\n")
    got = [r["prompt"] for r in _self(chatty, tmp_path / "c.jsonl", 4, seed=3, exclude=(str(exclude),))]
    assert got[:2] == [ref[1], ref[3]]
    assert not {normalise(ref[0]), normalise(ref[2])} & {normalise(t) for t in got}


def test_prompts_or_self_prompts_is_required():
    with pytest.raises(ConfigError, match="--prompts is required"):
        GenerateConfig(model="m", prompts=None, out="o")
    with pytest.raises(ConfigError, match="exclude each other"):
        GenerateConfig(model="m", prompts="p", self_prompts=3, out="o")


def test_cli_self_prompts_waives_prompts(tmp_path, capsys):
    from dflash.cli import main

    missing = tmp_path / "no-model"
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--self-prompts", "3", "--model", str(missing), "--out", str(tmp_path / "p.jsonl")])
    assert exc.value.code == 2
    assert f"--model {missing}: expected a Hugging Face model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(missing), "--out", str(tmp_path / "p.jsonl")])
    assert exc.value.code == 2
    assert "Missing option '--prompts'" in capsys.readouterr().err
