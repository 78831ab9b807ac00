"""Parity of our DFlash 1 and DFlash 2 drafters with z-lab's reference inference code, on the CPU in fp32.

    PYTHONPATH=PP python bench/dflash2_parity.py --reference /work/ref/zlab

--reference is a folder holding z-lab's `dflash/model.py` (github.com/z-lab/dflash), kept outside this repository;
it is loaded under another module name, since our package is also called dflash. For a tiny random drafter of each
architecture (every parameter random, the DFlash 2 convolutions and codebooks included; a sliding layer, the
target's output_multiplier, final_logit_softcapping and input_embedding_scale set) our weights are copied into
their DFlashDraftModel / DFlash2DraftModel and, over several contexts and anchors, compared: the block's final
hidden states, the draft logits (their compute_logits) and the drafted tokens (their propose: the selector's path;
argmax for DFlash 1). Then our `dflash export` folder is loaded with their from_pretrained, which must report no
missing or unexpected keys, and the comparison is repeated on the exported (bf16) weights, both sides in fp32.
Prints one JSON line per architecture; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from dflash.drafter.files import export_config, load_drafter, save_drafter_files, write_export
from dflash.drafter.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter, _draft_hidden, _logits, block_embeddings, draft_tokens

VOCAB, HIDDEN, BLOCK = 300, 64, 8


def load_reference(folder: Path):
    """Return z-lab's dflash/model.py as a module named zlab_dflash_model."""
    path = folder / "dflash" / "model.py"
    if not path.is_file():
        sys.exit(f"--reference {folder}: expected dflash/model.py (z-lab/dflash) inside, found none")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(drafter: str) -> DrafterConfig:
    """Return a tiny drafter config: 2 layers (sliding, full), a target with every logit/embedding scale set."""
    return DrafterConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, block_size=BLOCK,
                         target_layer_ids=(1, 3, 5), num_target_layers=8, mask_token_id=VOCAB - 1,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=12, drafter=drafter,
                         conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6,
                         output_multiplier=0.7, final_logit_softcapping=12.0, input_embedding_scale=1.5)


def random_drafter(cfg: DrafterConfig, seed: int) -> DFlashDrafter:
    """Return our drafter with every parameter random (norms near 1), so no part can hide behind its init."""
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def reference_model(ref, cfg: DrafterConfig, ours: DFlashDrafter):
    """Return their model of the same config, holding our weights (codebooks as their Embedding weights)."""
    from transformers import Qwen3Config

    config = Qwen3Config(**{k: v for k, v in export_config(cfg).items() if k not in ("dtype", "torch_dtype")})
    config._attn_implementation = "sdpa"
    cls = ref.DFlash2DraftModel if cfg.drafter == "dflash2" else ref.DFlashDraftModel
    theirs = cls(config).float().eval()
    sd = {k + (".weight" if k.endswith("_codebook") else ""): v for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    return theirs


def compare(ref, ours: DFlashDrafter, theirs, embed: torch.Tensor, head: nn.Linear, trials: int,
            seed: int) -> dict[str, float | int]:
    """Return max |ours - theirs| of hidden states and logits and the drafted tokens that differ, over trials."""
    cfg = ours.config
    g = torch.Generator().manual_seed(seed)
    worst = {"hidden": 0.0, "logits": 0.0, "tokens_differ": 0, "tokens": 0, "selector_changed_argmax": 0}
    for t in range(trials):
        S = int(torch.randint(3, 40, (1,), generator=g))  # the sliding window (12) cuts the longer contexts
        feats = torch.randn(S, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
        anchor = int(torch.randint(0, VOCAB - 1, (1,), generator=g))
        with torch.no_grad():
            h_ours = _draft_hidden(ours, feats, anchor, embed, S, False)
            ids = torch.full((1, BLOCK), cfg.mask_token_id)
            ids[0, 0] = anchor
            # Their generate loop scales the raw embedding by input_embedding_scale; ours does it in block_embeddings.
            noise = torch.nn.functional.embedding(ids, embed) * cfg.input_embedding_scale
            assert torch.equal(noise[0], block_embeddings(cfg, ids[0], embed))
            h_theirs = theirs(position_ids=torch.arange(S + BLOCK)[None], noise_embedding=noise,
                              target_hidden=feats[None])[0]
            l_ours = _logits(ours, h_ours[1:], head.weight)
            l_theirs = theirs.compute_logits(h_theirs[None, 1:], head)[0]
            tok_ours = draft_tokens(ours, feats, anchor, embed, head.weight, S)
            if cfg.drafter == "dflash2":
                tok_theirs = theirs.propose(h_theirs[None, 1:], torch.tensor([anchor]), head, 0.0)[0][0]
            else:
                tok_theirs = l_theirs.argmax(-1)
        worst["hidden"] = max(worst["hidden"], float((h_ours - h_theirs).abs().max()))
        worst["logits"] = max(worst["logits"], float((l_ours - l_theirs).abs().max()))
        worst["tokens_differ"] += int((tok_ours != tok_theirs).sum())
        worst["tokens"] += tok_ours.numel()
        worst["selector_changed_argmax"] += int((tok_ours != l_ours.argmax(-1)).sum())
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="folder with z-lab's dflash/model.py")
    parser.add_argument("--trials", type=int, default=20, help="contexts and anchors compared per drafter")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ref = load_reference(args.reference)
    torch.manual_seed(args.seed)
    embed = torch.randn(VOCAB, HIDDEN)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.5)
    failed = False
    for drafter in ("dflash", "dflash2"):
        cfg = tiny_config(drafter)
        ours = random_drafter(cfg, args.seed)
        row: dict = {"drafter": drafter, "trials": args.trials,
                     "random_weights": compare(ref, ours, reference_model(ref, cfg, ours), embed, head,
                                               args.trials, args.seed)}
        with tempfile.TemporaryDirectory() as tmp:
            save_drafter_files(ours, Path(tmp) / "ckpt")
            out = write_export(Path(tmp) / "ckpt", Path(tmp) / "export")
            cls = ref.DFlash2DraftModel if drafter == "dflash2" else ref.DFlashDraftModel
            loaded, info = cls.from_pretrained(str(out), output_loading_info=True, attn_implementation="sdpa")
            keys = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            row["from_pretrained"] = {k: v for k, v in keys.items()}
            row["exported_weights"] = compare(ref, load_drafter(out, dtype=torch.float32).eval(),
                                              loaded.float().eval(), embed, head, args.trials, args.seed + 1)
            row["architectures"] = json.loads((out / "config.json").read_text())["architectures"]
        ok = (not any(row["from_pretrained"].values())
              and all(r["tokens_differ"] == 0 and r["hidden"] < 1e-4 and r["logits"] < 1e-4
                      for r in (row["random_weights"], row["exported_weights"])))
        row["ok"] = ok
        failed |= not ok
        print(json.dumps(row))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
