"""Greedy DDTree decoding: the ancestor-only mask gives each node its path's own logits, decoding equals plain greedy
and a walk done prefix by prefix with separate forwards, the tree built on the device equals the heap's, the static
tree decoder (CUDA graphs' code, run eagerly here) equals the eager one, and the refusals (recurrent layers,
temperature > 0)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash.decode.drafting import drafter_proposer
from dflash.decode.speculative import greedy_decode, load_target
from dflash.decode.static_tree import StaticTreeDecoder, tree_decoders
from dflash.decode.tree import TreeDecoder, tree_unsupported
from dflash.drafter.tree import ancestor_mask, build_tree, device_tree, level_pairs
from dflash.errors import InputError
from dflash.facts import build_target_layer_ids
from dflash.targets.static_kv import StaticTarget
from test_speculative import FIT_PROMPTS, PROMPTS, _fitted_drafter
from test_static_decode import random_drafter

# transformers' or torch's internals: `DFLASH_CI=newest bash .ci/run` runs these on the newest releases
pytestmark = pytest.mark.internals


@pytest.fixture(scope="module")
def target64(tiny_qwen3):
    return load_target(tiny_qwen3, dtype=torch.float64)  # float64: no near-tie flips between the two walks


@pytest.fixture(scope="module")
def fitted64(tiny_qwen3, target64):
    layer_ids = build_target_layer_ids(target64.config.num_hidden_layers)
    target = load_target(tiny_qwen3)
    answers = [greedy_decode(target, p, max_new_tokens=40).tokens for p in FIT_PROMPTS]
    return _fitted_drafter(tiny_qwen3, target, layer_ids, answers).double().eval()


def test_the_ancestor_only_mask_gives_every_node_the_logits_of_its_path_alone(target64) -> None:
    prompt, anchor = [5, 17, 99, 3, 8], 42
    parents = [-1, 0, 0, 1, -1, 4, 2, 6]
    tokens = [7, 250, 11, 60, 33, 200, 1, 9]
    depths = [1, 2, 2, 3, 1, 2, 3, 4]
    st = StaticTarget(target64, max_len=32)
    st.forward(torch.tensor(prompt), torch.zeros(1, dtype=torch.long), len(prompt))
    P, n = len(prompt), len(parents)
    visible = torch.zeros(1 + n, P + 1 + n, dtype=torch.bool)
    visible[:, :P + 1] = True
    visible[1:, P + 1:] = ancestor_mask(parents)
    h, _ = st.forward(torch.tensor([anchor] + tokens), torch.tensor([P]), P + 1 + n,
                      rope_pos=P + torch.tensor([0] + depths), visible=visible)
    got = target64.lm_head(h)
    for i in range(-1, n):
        path, at = [], i
        while at >= 0:
            path.append(tokens[at])
            at = parents[at]
        alone = target64(input_ids=torch.tensor([prompt + [anchor] + path[::-1]])).logits[0, -1]
        torch.testing.assert_close(got[i + 1], alone, msg=f"node {i}")


def _walk_with_separate_forwards(target, drafter, prompt, *, budget, max_new_tokens) -> tuple[list[int], list[int]]:
    """Return (tokens, accepted) of a tree walk where every node's target token comes from its own forward over the
    whole sequence (no cache, no tree mask) and the drafter's context from a forward over what is committed."""
    layer_ids = drafter.config.target_layer_ids
    propose = drafter_proposer(drafter, target, logits=True)

    def argmax_after(seq):
        return int(target(input_ids=torch.tensor([seq])).logits[0, -1].argmax())

    tokens, accepted = [argmax_after(prompt)], []
    while len(tokens) < max_new_tokens:
        seq = prompt + tokens
        hs = target(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1][0] for i in layer_ids], -1)
        logp = torch.log_softmax(propose(context, tokens[-1], len(seq) - 1).float(), -1)
        top = torch.topk(logp, budget, dim=-1)
        tree = build_tree(top.values, top.indices, budget)
        at, new = -1, []
        while True:
            want = argmax_after(seq + new)
            child = [i for i in range(len(tree)) if tree.parents[i] == at and tree.tokens[i] == want]
            if not child:
                new.append(want)
                break
            at = child[0]
            new.append(want)
        new = new[: max_new_tokens - len(tokens)]
        accepted.append(len(new))
        tokens += new
    return tokens, accepted


def test_tree_decoding_equals_greedy_and_a_walk_with_separate_forwards(target64, fitted64) -> None:
    seen_deep = False
    for budget in (1, 12):
        decoder = TreeDecoder(target64, fitted64, budget=budget, max_len=64)  # one decoder, every prompt
        for prompt in FIT_PROMPTS:
            out = decoder.decode(prompt, max_new_tokens=20)
            assert out.tokens == greedy_decode(target64, prompt, max_new_tokens=20).tokens, (budget, prompt)
            tokens, accepted = _walk_with_separate_forwards(target64, fitted64, prompt, budget=budget,
                                                            max_new_tokens=20)
            assert (out.tokens, out.accepted) == (tokens, accepted), (budget, prompt)
            assert out.forwards == 1 + len(out.accepted) and len(out.tokens) == 1 + sum(out.accepted)
            seen_deep |= max(out.accepted) > 2
    assert seen_deep  # trees accepted paths of several drafts: the walk is really compared


def test_a_recurrent_target_and_sampling_are_refused_in_one_line(target64, fitted64) -> None:
    hybrid = SimpleNamespace(model_type="qwen3_5", layer_types=["linear_attention"] * 3 + ["full_attention"])
    assert "recurrent" in tree_unsupported(hybrid)
    with pytest.raises(InputError, match=r"^--tree-decode-nodes 8: this target cannot verify a tree: its recurrent") as e:
        TreeDecoder(SimpleNamespace(config=hybrid), fitted64, budget=8, max_len=16)
    assert "\n" not in str(e.value)
    assert tree_unsupported(target64.config) is None
    with pytest.raises(InputError, match="greedily only"):
        TreeDecoder(target64, fitted64, budget=4, max_len=16).decode([5, 3], max_new_tokens=4, temperature=0.7)


def _node_paths(tokens, parents) -> list[tuple[int, ...]]:
    out = []
    for i in range(len(tokens)):
        at, path = i, []
        while at >= 0:
            path.append(int(tokens[at]))
            at = int(parents[at])
        out.append(tuple(path[::-1]))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_built_on_the_device_holds_the_heaps_nodes_parents_first(seed) -> None:
    g = torch.Generator().manual_seed(seed)
    D, V = 4, 6
    lp = torch.log_softmax(torch.randn(D, V, generator=g, dtype=torch.float64) * 2, -1).float()
    for n in (1, 3, 8, 21, 64):
        values, ids = torch.topk(lp, min(n, V), dim=-1)
        cut = values.clone()
        cut[2:] = float("-inf")  # slots 3 and 4 take no node: fewer prefixes than n for n > 42
        for logp in (values, cut):
            heap = build_tree(logp, ids, n)
            tokens, parents, depths = device_tree(logp, ids, n, level_pairs(n, ids.shape[1], "cpu"))
            assert tokens.shape == parents.shape == depths.shape == (n,)
            kept = [i for i in range(n) if tokens[i] >= 0]
            assert len(kept) == len(heap)
            paths = _node_paths(tokens, parents)
            assert {paths[i] for i in kept} == set(_paths_of(heap))
            assert all(parents[i] < i and depths[i] == len(paths[i]) for i in kept)  # parents first, depths right
            assert depths.tolist() == sorted(depths.tolist())
            loop = torch.eye(n, dtype=torch.bool)
            for i, p in enumerate(parents.tolist()):
                if p >= 0:
                    loop[i] |= loop[p]
            assert torch.equal(ancestor_mask(parents, D), loop)


def _paths_of(tree) -> list[tuple[int, ...]]:
    return _node_paths(tree.tokens, tree.parents)


def test_static_tree_decoding_equals_greedy_and_the_eager_tree_decoder(target64, fitted64) -> None:
    seen_deep = False
    for budget in (1, 12):
        eager = TreeDecoder(target64, fitted64, budget=budget, max_len=64)
        static = StaticTreeDecoder(target64, fitted64, budget=budget, max_len=64)  # one decoder, every prompt
        assert not static.graphs  # on the CPU: the graphs' code, run eagerly
        for prompt in FIT_PROMPTS + PROMPTS[2:]:
            want = eager.decode(prompt, max_new_tokens=20)
            got = static.decode(prompt, max_new_tokens=20)
            assert got.tokens == greedy_decode(target64, prompt, max_new_tokens=20).tokens, (budget, prompt)
            assert (got.accepted, got.forwards) == (want.accepted, want.forwards), (budget, prompt)
            seen_deep |= max(got.accepted) > 2
        stop = want.tokens[5]  # a stop token ends the decoding where the eager one ends it
        assert static.decode(prompt, max_new_tokens=20, stop_ids=[stop]) == eager.decode(prompt, max_new_tokens=20,
                                                                                         stop_ids=[stop])
    assert seen_deep
    with pytest.raises(InputError, match="greedily only"):
        static.decode([5, 3], max_new_tokens=4, temperature=0.7)
    assert all(type(d) is TreeDecoder for d in tree_decoders(target64, fitted64, [4], PROMPTS,
                                                             max_new_tokens=8).values())  # a CPU: the eager one


def test_a_dflash2_drafters_static_tree_is_the_eager_ones(tiny_llama) -> None:
    """DFlash 2: both build the tree from the unary logits (the selector is the path's, not the tree's)."""
    target = load_target(tiny_llama)
    drafter = random_drafter(tiny_llama, target, drafter="dflash2", selector_rank=8, selector_top_k=4)
    eager = TreeDecoder(target, drafter, budget=8, max_len=40)
    static = StaticTreeDecoder(target, drafter, budget=8, max_len=40)
    for prompt in PROMPTS[:2]:
        want = eager.decode(prompt, max_new_tokens=12)
        assert static.decode(prompt, max_new_tokens=12) == want
        assert want.tokens == greedy_decode(target, prompt, max_new_tokens=12).tokens


@pytest.mark.gpu
def test_captured_tree_graphs_decode_as_the_eager_tree_loop_on_a_gpu(tiny_qwen3) -> None:
    """On a GPU, fp32: the captured tree graphs (one replay, one host sync per tree) give the eager TreeDecoder's
    tokens and accepted lengths, and greedy's tokens; tree_decoders picks them on CUDA."""
    target = load_target(tiny_qwen3, device="cuda")
    answers = [greedy_decode(target, p, max_new_tokens=40).tokens for p in FIT_PROMPTS]
    ids = build_target_layer_ids(target.config.num_hidden_layers)
    drafter = _fitted_drafter(tiny_qwen3, load_target(tiny_qwen3), ids, answers).to("cuda").eval()
    for budget in (4, 32):
        static = tree_decoders(target, drafter, [budget], FIT_PROMPTS + PROMPTS, max_new_tokens=40)[budget]
        assert type(static) is StaticTreeDecoder and static.graphs
        eager = TreeDecoder(target, drafter, budget=budget, max_len=64)
        for prompt in FIT_PROMPTS + PROMPTS:
            got = static.decode(prompt, max_new_tokens=40)
            assert got == eager.decode(prompt, max_new_tokens=40), (budget, prompt)
            assert got.tokens == greedy_decode(target, prompt, max_new_tokens=40).tokens, (budget, prompt)
