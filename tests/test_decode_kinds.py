"""Speculative decoding stays identical to greedy on every layer kind a target may have: sliding windows (per layer
type, or Mistral's global one) that the decoding runs past, attention sinks, and recurrent linear attention, whose
state a rejected draft must not advance."""
from __future__ import annotations

import random

import pytest
import torch

from dflash.decode.speculative import greedy_decode, speculative_decode, load_target
from dflash.targets.cache import records_linear_past

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals

WINDOW = 8  # shorter than prompt + answer: every sliding layer runs past its window


def _configs() -> dict:
    from transformers import GptOssConfig, MistralConfig, Qwen3_5TextConfig

    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16)
    return {
        "mistral-sliding": MistralConfig(intermediate_size=128, sliding_window=WINDOW, **common),
        "qwen3_5-hybrid": Qwen3_5TextConfig(
            intermediate_size=128, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, layer_types=["linear_attention"] * 3 + ["full_attention"], **common),
        "gpt_oss-sinks": GptOssConfig(intermediate_size=64, sliding_window=WINDOW, num_local_experts=4,
                                      num_experts_per_tok=2, **common),
    }


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    from transformers import AutoModelForCausalLM

    out = {}
    for name, config in _configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # weights large enough that layers matter and greedy ties are rare
            for n, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 1.0 if "embed" in n else 0.3)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = load_target(folder)
    return out


@pytest.mark.parametrize("name, by_hand", [(n, False) for n in sorted(_configs())] + [("qwen3_5-hybrid", True)])
def test_speculative_decoding_equals_greedy_on_every_layer_kind(targets, name, by_hand, monkeypatch):
    """by_hand: the rollback that saves and restores recurrent states itself, as on transformers before 5.25."""
    if by_hand:
        monkeypatch.setattr("dflash.targets.cache.records_linear_past", lambda: False)
    target = targets[name]
    prompt = list(range(5, 25))
    greedy = greedy_decode(target, prompt, max_new_tokens=30)
    truth = prompt + greedy.tokens
    rng = random.Random(0)

    def propose(context, anchor_id, anchor_pos):  # the greedy continuation, one slot spoiled half the time
        drafts = (truth[anchor_pos + 1: anchor_pos + 4] + [0, 0, 0])[:3]
        if rng.random() < 0.5:
            drafts[rng.randrange(3)] = 7
        return torch.tensor(drafts)

    spec = speculative_decode(target, propose, prompt, block_size=4, layer_ids=[0, 2], max_new_tokens=30)
    assert spec.tokens == greedy.tokens
    assert any(a < 4 for a in spec.accepted) and any(a == 4 for a in spec.accepted)  # drafts kept and cut
    blocks = len(spec.accepted)
    cut = sum(a < 4 for a in spec.accepted[:-1])
    # Where transformers records a recurrent layer's state after each token (5.25), its crop takes a cut block back
    # with no second forward; before, a recurrent target runs the kept tokens of a cut block again. Attention-only
    # targets never do.
    again = name.startswith("qwen3_5") and (by_hand or not records_linear_past())
    assert spec.forwards == 1 + blocks + (cut if again else 0)


def test_a_layer_mixing_attention_and_a_recurrent_state_drops_only_its_attention_tail():
    """A cache layer holding both keys/values and a recurrent state (transformers' mixed layers): the cut drops the
    attention tail; the state is the rollback's to restore (its own crop cannot take tokens back)."""
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

    from dflash.targets.cache import _attention_crop

    layer = LinearAttentionAndFullAttentionLayer()
    keys = torch.arange(7.0).view(1, 1, 7, 1).expand(1, 2, 7, 4).contiguous()
    layer.update(keys, keys.clone())
    _attention_crop(layer, 3)
    assert torch.equal(layer.keys, keys[:, :, :4]) and torch.equal(layer.values, keys[:, :, :4])
