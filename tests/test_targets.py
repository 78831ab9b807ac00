"""Every target family dflash supports, one row each: a tiny random target of the model type, saved in the class its
real checkpoints carry, through `dflash extract` (every stored feature equals the full model's), `dflash train` and
`dflash export`; and the refusals (one line, no store folder)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.tests.tiny_targets import TINY_ARCHS, TINY_WINDOW, build_tiny_target
from test_extract_run import one_torch_thread, store_samples, write_conversations  # noqa: F401
from test_extract_refusals import _one_line
from test_train_run import dflash_main

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals

LAYERS = (1, 2, 3, 4)  # of 6: the last layer is never run, every kind the tiny targets mix lies within these
# --codec blosc: these tests compare each family's stored features with its full model within one bf16 rounding step
# (the default, uq6, is lossy by design; tests/test_extract_run.py bounds its error).
FLAGS = ["--gpus", "cpu", "--dtype", "float32", "--max-length", "96", "--batch-tokens", "512", "--min-loss-tokens", "1",
         "--shard-size", "8", "--codec", "blosc"]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """Return a function building (once per session) the tiny 6-layer target of a model type."""
    root, built = tmp_path_factory.mktemp("targets"), {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_target(root / arch, arch, num_layers=6, hidden_size=32)
        return built[arch]

    return get


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    return write_conversations(tmp_path_factory.mktemp("targets-data") / "conv.jsonl", 8, bad={})


def _extract(capsys, model: Path, data: Path, out: Path, layers: tuple[int, ...] | None = LAYERS):
    """Return the CompletedProcess of `dflash extract` run in this process (--layers auto when layers is None)."""
    import subprocess

    args = ["extract", "--model", str(model), "--data", str(data), "--out", str(out), *FLAGS]
    if layers is not None:
        args += ["--layers", ",".join(map(str, layers))]
    return subprocess.CompletedProcess(args, *dflash_main(capsys, *args))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_extract_train_export(arch, tiny_target, conversations, tmp_path, capsys, one_torch_thread):  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = tiny_target(arch)
    store = tmp_path / "store"
    done = _extract(capsys, model, conversations, store)
    assert done.returncode == 0, done.stderr[-3000:]
    full = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    samples = store_samples(store)
    assert len(samples) == 8 and max(len(ids) for ids, _, _ in samples.values()) > 3 * TINY_WINDOW
    for row, (ids, _, bits) in samples.items():
        with torch.no_grad():
            states = full(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True)
        want = torch.stack([states.hidden_states[i + 1][0] for i in LAYERS], dim=1)
        got = torch.from_numpy(bits).view(torch.bfloat16).float()
        # fp32 features, stored in bf16: every value within one bf16 rounding step of the full model's.
        assert ((got - want).abs() <= 2.0**-7 * want.abs() + 1e-6).all(), f"{arch} row {row}: beyond bf16 rounding"
    run, export = tmp_path / "run", tmp_path / "export"
    code, _, err = dflash_main(capsys, "train", "--store", str(store), "--target", str(model), "--out", str(run),
                               "--gpus", "cpu", "--dtype", "float32", "--max-steps", "2", "--draft-layers", "1",
                               "--block-size", "4", "--batch-tokens", "256", "--anchors", "8", "--val-fraction", "0")
    assert code == 0, err[-3000:]
    code, _, err = dflash_main(capsys, "export", "--run", str(run), "--out", str(export))
    assert code == 0, err[-3000:]
    exported = json.loads((export / "config.json").read_text())
    # Full rotary, flat: what SGLang and vLLM both build from it, and what the drafter trained with.
    assert "partial_rotary_factor" not in json.dumps(exported) and "rope_theta" in exported["rope_parameters"]
    assert exported["dflash_config"]["target_layer_ids"] == list(LAYERS)
    # Decoding: one prompt, speculative with the exported drafter against greedy, through `dflash eval --prompts`
    # (a 2-step drafter is rejected more often than not: the cut path, and the recurrent layers' rollback, run).
    code, out, err = dflash_main(capsys, "eval", "--drafter", str(export), "--target", str(model), "--prompts",
                                 str(conversations), "--decode", "24", "--max-prompts", "1", "--json")
    assert code == 0, err[-3000:]
    decoded = json.loads(out)
    assert decoded["identical"] and decoded["identical_prompts"] == 1, decoded


def test_a_layer_kind_dflash_cannot_verify_is_refused_before_any_store(tmp_path, conversations, capsys):
    from transformers import AutoModelForCausalLM, Lfm2Config

    from dflash.tests.tiny_targets import build_tokenizer

    tok = build_tokenizer("chatml")
    path = tmp_path / "lfm2"
    config = Lfm2Config(vocab_size=len(tok) + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                        num_attention_heads=2, num_key_value_heads=1, full_attn_idxs=[2, 5])
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    proc = _extract(capsys, path, conversations, tmp_path / "store")
    _one_line(proc, "lfm2 has conv layers within the captured ones")
    assert not (tmp_path / "store").exists()


def test_a_runner_that_differs_from_the_full_model_is_refused_before_any_store(tmp_path, tiny_target, conversations,
                                                                               capsys, monkeypatch):
    """The hand-written loop dflash ran before (every layer with attention_mask=None) is wrong past Mistral's window:
    the self-check, on rows longer than every window, refuses it before the store exists."""
    from dflash.targets.runner import TargetRunner

    def unmasked(self, input_ids):
        text = self.text
        h = text.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1])[None]
        rope = text.rotary_emb(h, pos)
        out = []
        for j, layer in enumerate(text.layers):
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
            if j in self.layer_ids:
                out.append(h)
        return out

    monkeypatch.setattr(TargetRunner, "hidden", torch.inference_mode()(unmasked))
    proc = _extract(capsys, tiny_target("mistral"), conversations, tmp_path / "store")
    _one_line(proc, "cannot run this target exactly")
    assert "sliding_attention layers" in proc.stderr and not (tmp_path / "store").exists()


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma4"])
def test_the_head_is_read_from_a_wrapper_s_weight_names(arch, tiny_target):
    from transformers import AutoModelForCausalLM

    from dflash.targets.head import load_target_head

    model = tiny_target(arch)
    head = load_target_head(model)
    full = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert torch.equal(head.embed, full.get_input_embeddings().weight)
    assert torch.equal(head.lm_head, full.get_output_embeddings().weight)


def test_a_target_too_shallow_for_auto_layers_is_one_line(tmp_path, tiny_target, conversations, capsys):
    proc = _extract(capsys, tiny_target("qwen3_5"), conversations, tmp_path / "store", layers=None)
    _one_line(proc, "too shallow for 5 distinct DFlash feature layers")
    assert not (tmp_path / "store").exists()
