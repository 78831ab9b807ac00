"""Export and import: the folder DFlash inference loads, bit-identical round trip, checkpoint discovery, CLI."""
from __future__ import annotations

import json
import pytest
import torch
from safetensors import safe_open

from dflash.errors import InputError
from dflash.facts import build_target_layer_ids
from dflash.drafter.files import load_drafter, save_drafter_files
from dflash.drafter.folders import find_checkpoint
from dflash.train.export import export_drafter
from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter, draft_logits
from dflash.targets.head import load_target_head


@pytest.fixture()
def run_dir(tiny_qwen3, tmp_path):
    """A run folder with two complete checkpoints and a newer incomplete one; returns (run, newest model)."""
    cfg = DrafterConfig.from_target(tiny_qwen3, target_layer_ids=build_target_layer_ids(8), mask_token_id=262,
                                    draft_layers=2, block_size=8, sliding_window=16, full_every=2)
    models = []
    for step, seed in ((100, 0), (200, 1)):
        torch.manual_seed(seed)
        model = DFlashDrafter(cfg)
        model.reset_parameters(std=0.3)
        model = model.to(torch.bfloat16)
        save_drafter_files(model, tmp_path / "run" / "checkpoints" / f"step-{step:06d}")
        models.append(model)
    (tmp_path / "run" / "checkpoints" / "step-000300").mkdir()  # killed while saving: no config yet
    return tmp_path / "run", models[-1]


def test_newest_complete_checkpoint_is_chosen(run_dir) -> None:
    run, _ = run_dir
    assert find_checkpoint(run).name == "step-000200"
    assert find_checkpoint(run / "checkpoints" / "step-000100").name == "step-000100"
    with pytest.raises(InputError, match="dflash train"):
        find_checkpoint(run / "checkpoints")


def test_export_has_every_field_and_exactly_the_drafter_tensors(run_dir, tmp_path) -> None:
    run, model = run_dir
    out = export_drafter(run, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"target_layer_ids": build_target_layer_ids(8), "mask_token_id": 262}
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 16
    assert cfg["dtype"] == "bfloat16" and cfg["model_type"] == "qwen3"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings"):
        assert cfg[key] == getattr(model.config, key)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
    assert names == set(model.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert all(n.startswith("layers.") for n in names - {"fc.weight", "hidden_norm.weight", "norm.weight"})
    # transformers reads it as a Qwen3 config with our fields
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(out)
    assert hf.dflash_config["mask_token_id"] == 262 and hf.block_size == 8


def test_export_round_trip_is_bit_identical(run_dir, tiny_qwen3, tmp_path) -> None:
    run, model = run_dir
    out = export_drafter(run, tmp_path / "export")
    back = load_drafter(out)
    assert back.config == model.config
    head = load_target_head(tiny_qwen3, dtype=torch.bfloat16)
    feats = torch.randn(40, 5, model.config.hidden_size).to(torch.bfloat16)
    for anchor in (3, 25, 40):
        a = draft_logits(model, feats, 7, head.embed, head.lm_head, anchor_pos=anchor)
        b = draft_logits(back, feats, 7, head.embed, head.lm_head, anchor_pos=anchor)
        assert torch.equal(a, b)


def test_cli_export_and_its_errors(run_dir, tmp_path, capsys) -> None:
    from dflash.cli import main

    run, _ = run_dir
    out = tmp_path / "cli-export"
    with pytest.raises(SystemExit) as ok:
        main(["export", "--run", str(run), "--out", str(out)])
    assert ok.value.code == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as bad:
        main(["export", "--run", str(tmp_path / "nothing"), "--out", str(out)])
    err = capsys.readouterr().err
    assert bad.value.code == 2
    assert "dflash: error:" in err and "Traceback" not in err and "dflash train" in err


def test_checkpoint_with_foreign_tensors_is_refused(run_dir, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    run, _ = run_dir
    ckpt = run / "checkpoints" / "step-000200"
    sd = load_file(str(ckpt / "model.safetensors"))
    sd["embed_tokens.weight"] = torch.zeros(2, 2)
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(InputError, match="unexpected"):
        export_drafter(ckpt, tmp_path / "x")


def test_remote_code_export_loads_with_transformers_and_matches(run_dir, tiny_qwen3, tmp_path) -> None:
    from transformers import AutoModel, DynamicCache

    run, model = run_dir
    out = export_drafter(run, tmp_path / "remote", remote_code=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    hf = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ours = load_drafter(out, dtype=torch.float32)
    head = load_target_head(tiny_qwen3)
    H, B = model.config.hidden_size, model.config.block_size
    feats = torch.randn(40, 5 * H)
    ids = torch.tensor([7] + [model.config.mask_token_id] * (B - 1))
    with torch.no_grad():
        for S in (12, 40):  # 40 > sliding window 16: the sliding layer's mask matters
            want = draft_logits(ours, feats[:S], 7, head.embed, head.lm_head)
            hidden = hf(position_ids=torch.arange(S + B)[None], noise_embedding=head.embed[ids][None],
                        target_hidden=feats[None, :S])
            got = hf.compute_logits(hidden[0, 1:], lambda h: h @ head.lm_head.T)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # incremental use, as DFlash decoding does: context in two pieces through the cache, block dropped between
        cache = DynamicCache()
        hf(position_ids=torch.arange(0, 20 + B)[None], noise_embedding=head.embed[ids][None],
           target_hidden=feats[None, :20], past_key_values=cache, use_cache=True)
        cache.crop(-B)  # drop the block, keep the 20 context positions
        hidden = hf(position_ids=torch.arange(20, 40 + B)[None], noise_embedding=head.embed[ids][None],
                    target_hidden=feats[None, 20:40], past_key_values=cache, use_cache=True)
        got = hidden[0, 1:] @ head.lm_head.T
    torch.testing.assert_close(got, draft_logits(ours, feats, 7, head.embed, head.lm_head), rtol=1e-4, atol=1e-4)
