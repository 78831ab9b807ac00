"""A target's decoder layers streamed from host memory a layer ahead of the forward (targets/streamed.py): every
forward equals the model held whole, bit for bit, in the usual order, after the list is cut, after a forward that
failed inside a layer and when a layer runs out of order; each layer's weights live in one host buffer of exactly
their bytes, the device holds two slots; the copies are counted. On CUDA (marked gpu): the same with page-locked
host buffers and copies on their own stream."""
from __future__ import annotations

import contextlib
import copy
import re
import weakref

import pytest
import torch

from dflash.targets.adapter import text_model
from dflash.targets.streamed import LayerStream, stream_layers

# transformers' decoder layers under hooks that swap their parameters: `DFLASH_CI=newest bash .ci/run` runs these
pytestmark = pytest.mark.internals


def _model(layers: int = 5, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager").eval()


def _states(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(text_model(model)(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.cpu(), y.cpu()), f"hidden state {k} differs"


def test_forwards_equal_the_model_held_whole_and_every_layer_after_the_first_is_prefetched():
    whole = _model()
    streamed = copy.deepcopy(whole)
    stream = stream_layers(streamed, text_model(streamed), torch.device("cpu"))
    seen = []

    def in_a_slot(module, args, output):  # during its forward a layer's weights are the slot's, not the host's
        ptrs = [p.data_ptr() for p in module.parameters()]
        slots = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in stream.slots]
        seen.append(all(any(lo <= q < hi for lo, hi in slots) for q in ptrs))

    for layer in text_model(streamed).layers:
        layer.mlp.register_forward_hook(in_a_slot)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 97, (2, 40), generator=gen)
        _equal(_states(streamed, ids), _states(whole, ids))
    assert len(seen) == 15 and all(seen)
    s = stream.stats()
    assert s["out_of_order"] == 1, "only the very first layer is fetched when asked; every other one was ahead"
    assert s["copies"] >= 15 and s["copied_bytes"] == s["copies"] * stream.layers[0].nbytes
    assert streamed.lm_head is not whole.lm_head and isinstance(streamed.lm_head, torch.nn.Identity), \
        "the untied head extraction never runs is dropped"


def test_each_layer_lives_in_one_host_buffer_of_its_bytes_and_the_device_holds_two_slots():
    model = _model()
    text = text_model(model)
    text.layers[3].mlp.up_proj.weight = text.layers[1].mlp.up_proj.weight  # shared by two layers
    stream = LayerStream(text, torch.device("cpu"))
    for layer in stream.layers:
        lo, hi = layer.host.data_ptr(), layer.host.data_ptr() + layer.nbytes
        own = {id(p) for p, *_ in layer.params}
        for p in layer.module.parameters():
            inside = lo <= p.data_ptr() < hi
            assert inside == (id(p) in own), "a layer's own parameters, and only those, are views of its buffer"
        mine = sum(p.numel() * p.element_size() for p, *_ in layer.params)
        assert mine <= layer.nbytes < mine + 256 * len(layer.params), "exact bytes, aligned"
    import mmap

    pages = [(x.host.data_ptr() // mmap.PAGESIZE, (x.host.data_ptr() + x.nbytes - 1) // mmap.PAGESIZE)
             for x in stream.layers]
    assert all(x.host.data_ptr() % mmap.PAGESIZE == 0 for x in stream.layers)
    # ...and so does its storage: torch's is_pinned() asks the driver about the storage's first byte, which must be
    # inside the registered range on CUDA
    assert all(x.host.untyped_storage().data_ptr() == x.host.data_ptr() for x in stream.layers)
    assert all(a[1] < b[0] for a, b in zip(sorted(pages), sorted(pages)[1:])), \
        "no two layers' buffers share a page (the driver locks whole pages, and refuses one locked twice)"
    shared = text.layers[1].mlp.up_proj.weight
    assert all(id(shared) not in {id(p) for p, *_ in layer.params} for layer in stream.layers), \
        "a parameter two layers use stays on the device for both"
    assert len(stream.slots) == 2 and all(s.numel() == max(x.nbytes for x in stream.layers) for s in stream.slots)


def test_moving_a_large_target_s_layers_says_how_far_it_got(monkeypatch, caplog):
    import itertools

    import dflash.targets.streamed as streamed

    clock = itertools.count(0.0, 6.0)  # every layer "takes" 6 s: a line every other layer
    monkeypatch.setattr(streamed.time, "monotonic", lambda: next(clock))
    with caplog.at_level("INFO", logger="dflash.targets.streamed"):
        model = _model(layers=6)
        stream_layers(model, text_model(model), torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "decoder layers in" in r.getMessage()]
    assert lines and all(re.match(r"weights: \d of 6 decoder layers in their own host memory \(\d+\.\d GB, "
                                  r"\d+\.\d GB/s\)", x) for x in lines), lines


def test_a_cut_list_is_followed_and_trim_lets_the_cut_layers_go():
    whole = _model(layers=6)
    streamed = copy.deepcopy(whole)
    text = text_model(streamed)
    stream = stream_layers(streamed, text, torch.device("cpu"))
    ids = torch.randint(0, 97, (1, 33), generator=torch.Generator().manual_seed(2))
    _equal(_states(streamed, ids), _states(whole, ids))  # the self-check's full forward first, as a run does
    before = stream.host_bytes
    text.layers = text.layers[:4]
    text_model(whole).layers = text_model(whole).layers[:4]
    assert stream.trim() == 2 and stream.host_bytes == before * 4 // 6
    for _ in range(2):
        _equal(_states(streamed, ids), _states(whole, ids))


def test_a_cut_never_holds_more_than_two_slots_and_keeps_them_when_the_largest_layer_stays(monkeypatch):
    owner = torch.nn.Module()
    owner.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(64, 64)])
    stream = LayerStream(owner, torch.device("cpu"))
    big = stream.slots[0].numel()
    old = [weakref.ref(x) for x in stream.slots]
    alive, empty = [], torch.empty

    def spy(*args, **kwargs):
        alive.append(sum(r() is not None for r in old))
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    owner.layers = owner.layers[:2]  # the largest layer is cut: smaller slots, made once the old ones are gone
    assert stream.trim() == 1
    assert alive == [0, 0] and all(x.numel() < big for x in stream.slots)
    kept = list(stream.slots)
    owner.layers = owner.layers[:1]  # a cut that keeps a layer as large keeps the slots
    assert stream.trim() == 1 and all(a is b for a, b in zip(stream.slots, kept)) and alive == [0, 0]
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(owner.layers[0](x), x @ owner.layers[0].weight.T + owner.layers[0].bias)


def test_a_forward_that_failed_inside_a_layer_leaves_the_next_one_exact():
    whole = _model()
    streamed = copy.deepcopy(whole)
    text = text_model(streamed)
    stream = stream_layers(streamed, text, torch.device("cpu"))
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))

    def boom(module, args, output):
        raise RuntimeError("out of memory (simulated)")

    hook = text.layers[2].mlp.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="simulated"):
        _states(streamed, ids)
    hook.remove()
    # The retry's copies still run a layer ahead: the failed forward left a layer that does not come next in a slot,
    # which counts as free, so each layer's copy starts before the layer ahead of it gives its slot back.
    events = []
    fetch, release = stream._fetch, stream._release
    stream._fetch = lambda i, slot: (events.append(("fetch", i)), fetch(i, slot))[1]
    stream._release = lambda i: (events.append(("release", i)), release(i))[1]
    _equal(_states(streamed, ids), _states(whole, ids))
    del stream._fetch, stream._release
    events = events[events.index(("fetch", 0)):]  # the retry proper (before it: the failed layer given back)
    for i in range(1, 5):
        assert events.index(("fetch", i)) < events.index(("release", i - 1)), (i, events)
    # layers called on their own, out of order, still get their own weights
    h = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(5)[None]
    rope = text.rotary_emb(h, pos)
    with torch.no_grad():
        for i in (4, 0, 3):
            got = text.layers[i](h, position_embeddings=rope, position_ids=pos)
            want = text_model(whole).layers[i](h, position_embeddings=rope, position_ids=pos)
            got, want = (x[0] if isinstance(x, tuple) else x for x in (got, want))
            assert torch.equal(got, want), f"layer {i} called alone differs"
    assert stream.stats()["out_of_order"] >= 3
    stream.close()
    assert all(p.device.type == "cpu" for p in text.layers.parameters())


def test_the_kernel_choice_s_float32_reference_runs_through_the_stream():
    # kernels.choose upcasts each layer in turn in hooks of its own: around the stream's, so the reference is the
    # float32 forward of the streamed weights, and every weight is back in its host buffer, in its dtype, after it.
    from dflash.targets import kernels

    whole = _model(layers=4, dtype=torch.bfloat16)
    streamed = copy.deepcopy(whole)
    stream = stream_layers(streamed, text_model(streamed), torch.device("cpu"))
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(6))
    want = kernels.eager_float32_states(whole, text_model(whole), ids, 4, [40, 23])
    got = kernels.eager_float32_states(streamed, text_model(streamed), ids, 4, [40, 23])
    assert all(x.dtype == torch.float32 and torch.equal(x, y) for x, y in zip(got, want))
    bf16 = kernels.model_states(whole, ids, 4, [40, 23])
    assert not all(torch.equal(x.float(), y) for x, y in zip(bf16, want)), "the reference did run in float32"
    for layer in stream.layers:
        lo, hi = layer.host.data_ptr(), layer.host.data_ptr() + layer.nbytes
        assert all(p.dtype == torch.bfloat16 and lo <= p.data_ptr() < hi for p, *_ in layer.params)


def test_a_float32_reference_out_of_memory_inside_a_streamed_layer_falls_back_and_leaves_the_stream_exact(caplog):
    # On the GPU a streamed layer's float32 copy sits beside the two slots; a layer too large for that runs out of
    # memory inside the reference's forward, after the stream bound its weights and the upcast began.
    from dflash.targets import kernels

    whole = _model(layers=4, dtype=torch.bfloat16)
    streamed = copy.deepcopy(whole)
    text = text_model(streamed)
    stream = stream_layers(streamed, text, torch.device("cpu"))

    def oom(module, args):
        if module.weight.dtype == torch.float32:
            raise RuntimeError("out of memory (simulated)")

    hook = text.layers[2].mlp.down_proj.register_forward_pre_hook(oom)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(7))
    with caplog.at_level("WARNING", logger="dflash.targets.kernels"):
        chosen, _, _ = kernels.choose(streamed, text, ids, [40, 23], [0, 2], ["full_attention"] * 4, "bfloat16")
    hook.remove()
    assert any("the eager float32 reference cannot run here" in r.getMessage() for r in caplog.records)
    kernels.apply(whole, chosen)
    for _ in range(2):
        _equal(_states(streamed, ids), _states(whole, ids))
    for layer in stream.layers:
        lo, hi = layer.host.data_ptr(), layer.host.data_ptr() + layer.nbytes
        assert all(p.dtype == torch.bfloat16 and lo <= p.data_ptr() < hi for p, *_ in layer.params)


@pytest.mark.gpu
def test_on_cuda_host_layers_are_page_locked_and_forwards_equal_the_resident_model():
    device = torch.device("cuda", 0)
    whole = _model(layers=6, dtype=torch.bfloat16)
    streamed = copy.deepcopy(whole)
    whole.to(device)
    stream = stream_layers(streamed, text_model(streamed), device)
    assert stream.pinned and all(layer.host.is_pinned() for layer in stream.layers)
    gen = torch.Generator().manual_seed(5)
    side = torch.cuda.Stream(device)
    for k in range(4):
        ids = torch.randint(0, 97, (4, 128), generator=gen).to(device)
        want = _states(whole, ids)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side) if k == 3 else contextlib.nullcontext():  # a forward on a stream of its own
            got = _states(streamed, ids)
        torch.cuda.synchronize(device)
        for j, (x, y) in enumerate(zip(got, want)):  # the same kernels on the same weights: within bf16 rounding
            err = (x.float() - y.float()).abs().max().item()
            assert err <= 1e-2 * y.float().abs().max().item(), f"forward {k}, hidden state {j}: {err}"
    s = stream.stats()
    assert s["out_of_order"] == 1 and s["copy_gb_s"] > 0 and s["forward_wait_s"] >= 0
    assert all(p.device.type == "cpu" for p in text_model(streamed).layers.parameters()), \
        "between forwards every streamed weight is back in host memory"
