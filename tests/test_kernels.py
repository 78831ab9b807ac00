"""targets/kernels.py: the attention and experts kernels chosen per target and device, the self-check against the
model's eager float32 forward, and the fallback (logged, recorded in the header and every commit record) when a
kernel differs: real tiny targets, real kernels registered through transformers' own interfaces."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from dflash.targets import kernels
from dflash.targets.kernels import Kernels
from dflash.tests.tiny_targets import TINY_WINDOW
from test_targets import LAYERS, _extract, conversations, tiny_target  # noqa: F401
from test_extract_run import one_torch_thread  # noqa: F401


@pytest.mark.parametrize("arch, device, want", [
    ("gpt_oss", "cuda", ["flex_attention", "eager"]),  # sinks: no SDPA; flex takes them on CUDA
    ("gpt_oss", "cpu", ["eager"]),  # flex with sinks does not run on the CPU
    ("mistral", "cuda", ["flex_attention", "sdpa", "eager"]),  # windows: flex skips the hidden blocks
    ("mistral", "cpu", ["sdpa", "eager"]),
    ("qwen3", "cuda", ["sdpa", "eager"]),  # full attention alone: SDPA's flash kernel, no mask
    ("deepseek_v3", "cuda", ["sdpa", "eager"]),
])
def test_the_attention_order_per_target_and_device(arch, device, want, tiny_target, monkeypatch):  # noqa: F811
    from transformers import AutoConfig

    from dflash.targets.adapter import _causal_lm_class, attention_for, layer_kinds, text_config

    from dflash.targets import attention

    monkeypatch.setattr(kernels, "_flash_attn_installed", lambda: False)
    monkeypatch.setattr(attention, "usable", lambda d: False)  # a device without cuDNN's attention (the next test's)
    config = AutoConfig.from_pretrained(tiny_target(arch))
    cls = _causal_lm_class(config)
    assert kernels.attention_order(cls, layer_kinds(text_config(config)), torch.device(device)) == want
    assert attention_for(config, torch.device(device)) == want[0]


@pytest.mark.parametrize("arch, device, want", [
    ("deepseek_v3", "cuda", ["cudnn_padded", "sdpa", "eager"]),  # MLA: flash does not take its head dims
    ("deepseek_v3", "cpu", ["sdpa", "eager"]),
    ("qwen3", "cuda", ["sdpa", "eager"]),  # flash takes it: cuDNN's plans cost more than its kernel saved
    ("mistral", "cuda", ["flex_attention", "sdpa", "eager"]),
    ("gpt_oss", "cuda", ["flex_attention", "eager"]),  # sinks: no SDPA, no cuDNN
])
def test_on_hopper_mla_tries_cudnn_first(arch, device, want, tiny_target, monkeypatch):  # noqa: F811
    """Where targets/attention.py is usable (a CUDA device of capability 9.0 or more with cuDNN: what this machine
    lacks is its GPU, so usable() is what is replaced), cuDNN's attention is tried first for MLA's unequal head dims,
    both at load (attention_for, from the config) and in the self-check (candidates, from the model)."""
    from transformers import AutoConfig

    from dflash.targets import attention
    from dflash.targets.adapter import _causal_lm_class, attention_for, layer_kinds, text_config

    monkeypatch.setattr(kernels, "_flash_attn_installed", lambda: False)
    monkeypatch.setattr(attention, "usable", lambda d: torch.device(d).type == "cuda" and attention.register())
    config = AutoConfig.from_pretrained(tiny_target(arch))
    kinds = layer_kinds(text_config(config))
    assert kernels.attention_order(_causal_lm_class(config), kinds, device, config) == want
    assert attention_for(config, device) == want[0]
    model = _load(tiny_target(arch))
    assert [k.attention for k in kernels.candidates(model, kinds, device)][:: len(kernels.experts_order(device))
                                                                           if kernels.has_experts(model) else 1] == want


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3", "gemma3_text", "qwen3_5"])
def test_dflash_cudnn_attention_pads_lengths_and_equals_sdpa(arch, tiny_target, monkeypatch):  # noqa: F811
    """The padded path (off CUDA it runs SDPA's own kernels on the padded rows) gives the model's SDPA forward to
    float32 rounding: GQA (qwen3), MLA's unequal head dims (deepseek_v3), Gated DeltaNet beside full attention
    (qwen3_5); every unmasked call sees a length rounded up to GRANULE, and a window's masked layers (gemma3_text's
    sliding layers beside its full ones) run transformers' SDPA forward on their own length."""
    from dflash.targets import attention
    from dflash.targets.adapter import text_model

    model = _load(tiny_target(arch))
    ids = torch.randint(0, 200, (2, 3 * TINY_WINDOW + 5))
    seen: list[tuple[int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kw):
        seen.append((q.shape[2], attn_mask is None))
        return sdpa(q, k, v, attn_mask, *args, **kw)

    def states():
        with torch.no_grad():
            return model(input_ids=ids, output_hidden_states=True).hidden_states

    kernels.apply(model, Kernels("sdpa", kernels.current(model).experts))
    want = states()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    kernels.apply(model, Kernels(attention.NAME, kernels.current(model).experts))
    assert text_model(model, "t").config._attn_implementation == attention.NAME
    got = states()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    padded = [n for n, unmasked in seen if unmasked]
    assert padded and all(n == attention.GRANULE for n in padded), seen  # 29 tokens rounded up to 256
    masked = [n for n, unmasked in seen if not unmasked]
    assert (masked and all(n == ids.shape[1] for n in masked)) if arch == "gemma3_text" else not masked, seen


def _load(path, dtype=torch.float32):
    from dflash.targets.load import load_for_features

    return load_for_features(path, torch.device("cpu"), dtype)


def test_moe_targets_try_grouped_gemms_then_the_loop_and_dense_ones_have_no_experts(tiny_target):  # noqa: F811
    """On the CPU transformers' grouped GEMMs, then its loop; on CUDA dflash's forward-only grouped GEMMs before both
    (the order is the device's name: no GPU is needed to ask it)."""
    moe, dense = _load(tiny_target("qwen3_moe")), _load(tiny_target("qwen3"))
    assert kernels.candidates(moe, ["full_attention"], "cpu") == [
        Kernels("sdpa", "grouped_mm"), Kernels("sdpa", "eager"), Kernels("eager", "grouped_mm"),
        Kernels("eager", "eager")]
    assert kernels.candidates(dense, ["full_attention"], "cpu") == [Kernels("sdpa"), Kernels("eager")]
    assert kernels.candidates(moe, ["full_attention"], torch.device("cuda", 3))[:3] == [
        Kernels("sdpa", "dflash_grouped_mm"), Kernels("sdpa", "grouped_mm"), Kernels("sdpa", "eager")]
    assert kernels.candidates(dense, ["full_attention"], "cuda") == [Kernels("sdpa"), Kernels("eager")]


def test_the_float32_reference_of_a_bf16_target_is_its_float32_forward_and_leaves_it_bit_exact(tiny_target):  # noqa: F811
    from dflash.targets.adapter import text_model

    model = _load(tiny_target("gpt_oss"), torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 200, (2, 3 * TINY_WINDOW))
    # Neither vocabulary-sized matrix is copied to float32 (on a GPU the check's largest allocations).
    seen = []
    text_model(model).layers[0].register_forward_pre_hook(lambda m, a: seen.append(
        (model.get_input_embeddings().weight.dtype, model.get_output_embeddings().weight.dtype, a[0].dtype)))
    got = kernels.eager_float32_states(model, text_model(model), ids, 5, [3 * TINY_WINDOW, 11])
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.float32)]
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    # The same weights, made float32 whole: the upcast one layer at a time computes the same forward.
    model32 = _load(tiny_target("gpt_oss"), torch.bfloat16).float()
    want = kernels.model_states(model32, ids, 5, [3 * TINY_WINDOW, 11])
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and torch.allclose(g, w, rtol=1e-5, atol=1e-5)


def _register_wrong_kernels():
    """Register, through transformers' own interfaces, an attention that ignores the sliding window (the whole
    causal prefix instead) and experts that ignore the routing weights: real kernels that run, and are wrong."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def no_window(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    def unweighted(self, hidden_states, top_k_index, top_k_weights):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, torch.ones_like(top_k_weights))

    AttentionInterface.register("test_no_window", no_window)
    AttentionMaskInterface.register("test_no_window", sdpa_mask)
    ALL_EXPERTS_FUNCTIONS.register("test_unweighted", unweighted)


@pytest.mark.parametrize("arch, first, chosen", [
    ("mistral", Kernels("test_no_window"), Kernels("sdpa")),
    ("qwen3_moe", Kernels("sdpa", "test_unweighted"), Kernels("sdpa", "grouped_mm")),
])
def test_a_kernel_that_differs_is_not_used_and_the_run_says_so(arch, first, chosen, tiny_target, conversations,  # noqa: F811
                                                             tmp_path, capsys, monkeypatch, one_torch_thread):  # noqa: F811
    from dflash.storage import Store
    from test_extract_run import store_samples
    from transformers import AutoModelForCausalLM

    _register_wrong_kernels()
    real = kernels.candidates
    monkeypatch.setattr(kernels, "candidates", lambda model, kinds, device: [first] + real(model, kinds, device))
    store = tmp_path / "store"
    done = _extract(capsys, tiny_target(arch), conversations, store)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stderr
    assert f"{first}: differs from the model's eager float32 forward by" in said and f"trying {chosen}" in said
    assert f"kernels: {chosen} (checked against the model's eager float32 forward" in said
    header = Store.open(str(store)).header
    assert header["kernels"] == chosen.to_dict() and "kernels" in header["informational"]
    records = list((store / "commits").glob("*.json"))
    assert records and all(json.loads(r.read_text())["extra"]["kernels"] == chosen.to_dict() for r in records)
    # And the features are the full model's (float32: within one bf16 rounding step once stored).
    full = AutoModelForCausalLM.from_pretrained(tiny_target(arch), dtype=torch.float32).eval()
    for ids, _, bits in store_samples(store).values():
        with torch.no_grad():
            states = full(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True)
        want = torch.stack([states.hidden_states[i + 1][0] for i in LAYERS], dim=1)
        got = torch.from_numpy(bits).view(torch.bfloat16).float()
        assert ((got - want).abs() <= 2.0**-7 * want.abs() + 1e-6).all()


def test_a_bf16_run_allows_the_drift_its_own_eager_kernels_show(tiny_target, caplog):  # noqa: F811
    """In bf16 a kernel is compared with the eager float32 forward: past the fixed bound, it is still taken when it
    drifts no more than twice the model's own eager kernels in bf16 (the dtype's rounding, not the kernel)."""
    from dflash.targets.adapter import text_model

    model = _load(tiny_target("qwen3_moe"), torch.bfloat16)
    ids = torch.randint(0, 200, (2, 96))
    lengths = [96, 51]
    ref = kernels.eager_float32_states(model, text_model(model), ids, 5, lengths)
    kernels.apply(model, Kernels("eager", "eager"))
    eager = kernels.relative_error(kernels.model_states(model, ids, 5, lengths), ref)[0]
    assert 0 < eager < kernels.TOLERANCE["bfloat16"]
    tight = {**kernels.TOLERANCE, "bfloat16": eager / 100}  # every bf16 kernel is past it
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.INFO, logger="dflash"):
        mp.setattr(kernels, "TOLERANCE", tight)
        chosen, _, _ = kernels.choose(model, text_model(model), ids, lengths, list(LAYERS), ["full_attention"],
                                      "bfloat16")
    assert chosen == Kernels("sdpa", "grouped_mm"), caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt_oss", "mistral", "qwen3_moe", "deepseek_v3", "gemma3_text"])
def test_on_cuda_the_fastest_kernels_are_exact_and_taken(arch, tiny_target, caplog):  # noqa: F811
    """On CUDA in bf16 the first candidate (flex for sinks and windows, dflash's grouped GEMMs for experts) passes
    the self-check on rows longer than every window, and the cut runner's features equal the eager float32 model's."""
    from transformers import AutoModelForCausalLM

    from dflash.targets.load import load_for_features
    from dflash.targets.runner import TargetRunner

    dev = torch.device("cuda")
    model = load_for_features(tiny_target(arch), dev, torch.bfloat16)
    from dflash.targets.adapter import layer_kinds, text_config, text_model

    kinds = layer_kinds(text_config(text_model(model).config))[: max(LAYERS) + 1]
    first = kernels.candidates(model, kinds, dev)[0]
    torch._dynamo.reset()  # flex's compiled variants of earlier tests in this process count towards torch's limit
    with caplog.at_level(logging.WARNING, logger="dflash"):
        runner = TargetRunner(model, list(LAYERS), check_length=4 * TINY_WINDOW)
    passed_over = [r for r in caplog.records if r.name.startswith("dflash")]  # not transformers' config warnings
    assert runner.kernels.attention == first.attention and not passed_over, caplog.text
    assert runner.kernels.experts == first.experts in (None, "dflash_grouped_mm"), caplog.text
    assert runner.kernels.attention != "eager"
    ids = torch.randint(0, 200, (1, 5 * TINY_WINDOW), device=dev)
    got = runner.hidden(ids)

    def eager(dtype: torch.dtype) -> tuple:
        m = AutoModelForCausalLM.from_pretrained(tiny_target(arch), dtype=dtype).to(dev).eval()
        kernels.apply(m, Kernels("eager", "eager" if runner.kernels.experts else None))
        with torch.no_grad():
            return m(input_ids=ids, output_hidden_states=True).hidden_states

    want, own = eager(torch.float32), eager(torch.bfloat16)
    for g, i in zip(got, LAYERS):
        # Within bf16's rounding: 5% of the whole tensor, or twice what the model's own eager kernels drift in bf16
        # (a token whose top-k experts tie within rounding is routed otherwise in bf16, whatever the kernel; a wrong
        # kernel moves every token past a window, far beyond either).
        drift = float((own[i + 1].float() - want[i + 1]).norm() / want[i + 1].norm())
        err = float((g.float() - want[i + 1]).norm() / want[i + 1].norm())
        assert err < max(0.05, 2 * drift), (arch, i, err, drift)


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_where_the_float32_reference_cannot_run_the_kernels_are_checked_against_eager_in_the_runs_dtype(
        tiny_target, monkeypatch):  # noqa: F811
    """A layer too large to upcast on its device (injected here: the upcast fails as an out-of-memory would): the
    check falls back to the model's own eager kernels in the run's dtype, and says so."""
    import contextlib

    from dflash.targets.runner import TargetRunner

    @contextlib.contextmanager
    def no_room(model, layers):
        raise RuntimeError("out of memory (injected)")
        yield  # pragma: no cover

    monkeypatch.setattr(kernels, "_upcast", no_room)
    said, logger = _Said(), logging.getLogger("dflash.targets.kernels")
    logger.addHandler(said)
    level, logger.level = logger.level, logging.INFO
    try:
        runner = TargetRunner(_load(tiny_target("mistral"), torch.bfloat16), list(LAYERS), check_length=96)
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    assert any("the eager float32 reference cannot run here (RuntimeError: out of memory (injected))" in s
               for s in said.lines), said.lines
    assert any(s.startswith(f"kernels: {runner.kernels} (checked against the model's eager bfloat16 forward")
               for s in said.lines), said.lines


def test_one_token_routed_otherwise_is_rounding_and_a_lost_window_is_not() -> None:
    """relative_error on states made by hand: a layer update that differs wholly on one token of 100 (a tie
    between experts broken the other way) stays within bf16's bound; one that differs on the 20 past a window
    does not."""
    g = torch.Generator().manual_seed(0)
    want = [torch.randn(3, 100, 16, generator=g)]
    one = [want[0].clone()]
    one[0][2, 7] += torch.randn(16, generator=g) * 3
    window = [want[0].clone()]
    window[0][2, 80:] += torch.randn(20, 16, generator=g)
    assert kernels.relative_error(want, want) == (0.0, 0, 0)
    assert kernels.relative_error(one, want)[0] < kernels.TOLERANCE["bfloat16"]
    err, layer, row = kernels.relative_error(window, want)
    assert err > 0.5 and (layer, row) == (1, 0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_dflash_experts_equal_transformers_grouped_gemms(arch, tiny_target):  # noqa: F811
    """targets/experts.py on real tiny experts modules (concatenated and interleaved gates, biases, transposed
    weights): the same sums as transformers' grouped_mm forward, in float32 to its rounding and in bf16 to a few of
    bf16's (float32 routing weights too, as DeepSeek-V3's router gives them), with an expert no token takes; the
    whole model's forward through transformers' interface equals grouped_mm's; under autograd it is transformers'
    own forward."""
    import transformers
    from transformers.integrations.moe import grouped_mm_experts_forward

    from dflash.targets import experts

    assert experts.register()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS[experts.NAME] is experts.forward  # what a module set to NAME dispatches to
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        model = _load(tiny_target(arch), dtype)
        module = next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_concatenated"))
        if tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 25):
            # what forward() reads to leave expert parallelism and per-expert norms to transformers: a rename must
            # fail here, not send such a module down the lean path
            assert module._is_expert_parallel is False and module.has_post_expert_norm is False
        torch.manual_seed(0)
        tokens, k = 37, 2
        x = torch.randn(tokens, model.config.hidden_size, dtype=dtype)
        index = torch.stack([torch.randperm(module.num_experts - 1)[:k] for _ in range(tokens)])  # the last: none
        index[0] = index[1]  # two tokens on the same experts
        for weights in (torch.rand(tokens, k).to(dtype), torch.rand(tokens, k)):
            with torch.no_grad():
                want = grouped_mm_experts_forward(module, x, index, weights)
                got = experts.forward(module, x, index, weights)
            assert got.shape == want.shape and got.dtype == want.dtype
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            assert err < tol, (arch, dtype, weights.dtype, err)
            # inside a compiled layer the scatter and the batched matmul are one fused gather and float32 sum
            compiled = torch.compile(lambda *a: experts.forward(module, *a), dynamic=True)
            with torch.no_grad():
                fused = compiled(x, index, weights)
            assert fused.shape == want.shape and fused.dtype == want.dtype
            err = float((fused.float() - want.float()).abs().max() / want.float().abs().max())
            assert err < tol, ("compiled", arch, dtype, weights.dtype, err)
        # a wrong routing weight is far outside it
        with torch.no_grad():
            off = experts.forward(module, x, index, weights.flip(-1))
        assert float((off.float() - want.float()).abs().max() / want.float().abs().max()) > 10 * tol
    with torch.enable_grad():  # training's path is transformers' own, bit for bit
        assert torch.equal(experts.forward(module, x, index, weights),
                           grouped_mm_experts_forward(module, x, index, weights))
    model = _load(tiny_target(arch))  # float32: the model's forward through the interface, both ways
    ids = torch.randint(0, 200, (2, 48))
    states = {}
    for name in ("grouped_mm", experts.NAME):
        kernels.apply(model, Kernels(kernels.current(model).attention, name))
        assert kernels.current(model).experts == name
        with torch.no_grad():
            states[name] = model(input_ids=ids, output_hidden_states=True).hidden_states
    for a, b in zip(states["grouped_mm"], states[experts.NAME]):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4


@pytest.mark.internals  # transformers' output-capturing hooks and dynamo's graph breaks: every new release
def test_a_compiled_layer_is_one_graph_and_the_check_still_reads_hidden_states(tiny_target):  # noqa: F811
    """compile_layers drops transformers' output-capturing hooks from a layer's attention and router, which torch
    cannot trace (each split the compiled layer: a Qwen3-MoE layer was 7 graphs), and keeps the layer's own, which
    output_hidden_states (the self-check's reference) reads: a compiled forward breaks at most once a layer kind,
    after the layer's work, and the model's hidden states are those of its eager layers."""
    from torch._dynamo.utils import counters

    from dflash.targets.adapter import text_model

    model = _load(tiny_target("qwen3_moe"))
    ids = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model(input_ids=ids, output_hidden_states=True).hidden_states  # installs transformers' hooks
    layers = text_model(model, "tiny").layers
    hooked = [m for m in layers[0].modules() if m is not layers[0] and m._forward_hooks]
    assert hooked, "transformers installed no output-capturing hook on a layer's parts: this test checks nothing"
    torch._dynamo.reset()
    counters.clear()
    kernels.compile_layers(layers)
    try:
        with torch.inference_mode():
            got = model(input_ids=ids, output_hidden_states=True).hidden_states
        breaks = dict(counters["graph_break"])
        assert sum(breaks.values()) <= 1, breaks
        assert all(not m._forward_hooks for layer in layers for m in layer.modules() if m is not layer)
        assert all(layer._forward_hooks for layer in layers)  # the layer's own: output_hidden_states
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    finally:
        kernels.compile_layers(layers, on=False)
        torch._dynamo.reset()


@pytest.mark.internals  # torch.compile's module compilation and dynamo's limits: run on every new torch release
def test_compiled_layers_are_checked_like_a_kernel_and_give_eager_features(tiny_target, caplog,  # noqa: F811
                                                                          monkeypatch):
    """--compile-layers: the decoder layers under torch.compile (inductor, dynamic shapes) pass the same self-check as a
    kernel, are named in the runner's kernels (the log, the header, every commit record), and give the eager layers'
    features on batches of other shapes than the check's, the captured layers' hooks included. With warm_tokens
    (extract passes its batch size on CUDA) their first call is a batch of about that many tokens in rows the
    check's length allows, then one row of that length (kernels.warm_forward: inductor takes its size hints and
    Triton its first-launch tuning from the first call, not from the check's 2 rows of 96 tokens), and later
    batches compile nothing more. The check's states come from the graphs the run uses (the text model called as
    the runner calls it): the full model's output_hidden_states compiled graphs of its own on the check's rows, and
    on one H100 their other roundings moved a tied routing by 2.6% and the runner's check refused the target."""
    from torch._dynamo.utils import counters

    from dflash.targets.runner import TargetRunner

    path = tiny_target("qwen3_moe")
    eager = TargetRunner(_load(path), list(LAYERS))
    torch._dynamo.reset()
    counters.clear()
    model, shapes = _load(path), []
    model.model.embed_tokens.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    graphs_at = {}  # graphs compiled after the warm batch's: the check and the runner run the warm batch's graphs
    warm, differs = kernels.warm_forward, TargetRunner._differs

    def warmed(*args):
        warm(*args)
        graphs_at["warm"] = counters["stats"]["unique_graphs"]

    def compared(*args):
        assert differs(*args) is None
        graphs_at["compare"] = counters["stats"]["unique_graphs"]

    monkeypatch.setattr(kernels, "warm_forward", warmed)
    monkeypatch.setattr(TargetRunner, "_differs", compared)
    with caplog.at_level(logging.INFO, logger="dflash"):
        runner = TargetRunner(model, list(LAYERS), check_length=200, compile_layers=True, warm_tokens=600)
    assert graphs_at["compare"] == graphs_at["warm"] > 0, "the check's states came from graphs the run does not use"
    assert runner.kernels.compiled and not eager.kernels.compiled, caplog.text
    assert "layers compiled" in str(runner.kernels) and runner.kernels.to_dict()["compiled"] is True
    assert "decoder layers compiled in" in caplog.text and "run eager" not in caplog.text
    assert "first on 3 x 200 tokens" in caplog.text
    # the candidates' eager checks on the check's rows, then the compiled layers: the run's size first
    assert shapes[-4:] == [(3, 200), (2, 96), (2, 96), (1, 200)] and (3, 200) not in shapes[:-4], shapes
    graphs = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(1)
    for shape in ((3, 40), (1, 77)):  # dynamic shapes: no recompilation per batch shape needed for exactness
        ids = torch.randint(0, 200, shape, generator=gen)
        for got, want in zip(runner.hidden(ids), eager.hidden(ids)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs > 0, "a batch of the run compiled anew"

    # A compiled layer that fails later (a new kind of batch compiled anew, the compiler failing on it): the batch
    # and the ones after it run eager, with a warning, and the runner's kernels (every later commit record) say so.
    def compiler_fails(*args, **kwargs):
        raise RuntimeError("inductor: a batch this compiler cannot take")

    for layer in runner.text.layers:
        layer._compiled_call_impl = compiler_fails
    ids = torch.randint(0, 200, (2, 51), generator=gen)
    with caplog.at_level(logging.WARNING, logger="dflash"):
        got = runner.hidden(ids)
    assert "compiled decoder layers failed on a batch of 2 x 51 tokens (RuntimeError: inductor" in caplog.text
    assert not runner.kernels.compiled and "layers compiled" not in str(runner.kernels)
    for g, want in zip(got, eager.hidden(ids)):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)


def test_compiled_layers_whose_cut_forward_differs_from_the_check_run_eager(tiny_target, caplog,  # noqa: F811
                                                                           monkeypatch):
    """Compiled layers that pass the self-check but whose cut forward then differs from the states the check read
    (one token of a captured layer, as a tied routing moved by other roundings: on one H100 the target was refused)
    run eager, with a warning that says where, after the eager layers pass the same strict comparison."""
    from dflash.targets.runner import TargetRunner

    path = tiny_target("qwen3_moe")
    eager = TargetRunner(_load(path), list(LAYERS))
    states = kernels.layer_states

    def one_token_moved(text, ids, depth, lengths):
        got = states(text, ids, depth, lengths)
        got[0][LAYERS[0] + 1, 5] += 10 * got[0][LAYERS[0] + 1].abs().max()
        return got

    monkeypatch.setattr(kernels, "layer_states", one_token_moved)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="dflash"):
        runner = TargetRunner(_load(path), list(LAYERS), compile_layers=True)
    assert "decoder layers compiled in" in caplog.text, caplog.text  # the self-check's percentile passed it
    assert f"the compiled decoder layers: the truncated forward's layer {LAYERS[0]} differs" in caplog.text
    assert "they run eager" in caplog.text
    assert not runner.kernels.compiled and all(layer._compiled_call_impl is None for layer in runner.text.layers)
    ids = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(3))
    for got, want in zip(runner.hidden(ids), eager.hidden(ids)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_that_do_not_compile_run_eager_with_a_warning(tiny_target, caplog, monkeypatch):  # noqa: F811
    """A target whose layers torch cannot compile here keeps its checked kernels and eager layers, and says why."""
    import torch._dynamo

    from dflash.targets.runner import TargetRunner

    def fails(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("a layer this torch cannot trace")

    model = _load(tiny_target("qwen3"))
    monkeypatch.setattr(type(model.model.layers[0]), "compile", fails)
    with caplog.at_level(logging.WARNING, logger="dflash"):
        runner = TargetRunner(model, list(LAYERS), compile_layers=True)
    assert not runner.kernels.compiled and runner.kernels.attention == "sdpa"
    assert "with its layers compiled: cannot run here (Unsupported: a layer this torch cannot trace)" in caplog.text
    assert all(layer._compiled_call_impl is None for layer in runner.text.layers)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe", "deepseek_v3", "qwen3_5"])
def test_on_cuda_compiled_layers_are_exact_and_taken(arch, tiny_target, caplog):  # noqa: F811
    """On CUDA in bf16 the fastest kernels with every decoder layer compiled (flex for the sinks and windows inside
    the compiled layers, dflash's grouped GEMMs, Gated DeltaNet layers around flash-linear-attention's kernels where
    the lent image has it), first called on a batch of the run's size as extract calls them,
    pass the self-check, and give the eager layers' features within bf16 rounding on a batch of another shape."""
    from dflash.targets.load import load_for_features
    from dflash.targets.runner import TargetRunner

    dev = torch.device("cuda")
    torch._dynamo.reset()
    eager = TargetRunner(load_for_features(tiny_target(arch), dev, torch.bfloat16), list(LAYERS),
                         check_length=4 * TINY_WINDOW)
    with caplog.at_level(logging.INFO, logger="dflash"):
        runner = TargetRunner(load_for_features(tiny_target(arch), dev, torch.bfloat16), list(LAYERS),
                              check_length=200, compile_layers=True, warm_tokens=1600)
    assert runner.kernels.compiled and runner.kernels.attention == eager.kernels.attention, caplog.text
    assert "first on 8 x 200 tokens" in caplog.text  # extract's first call on CUDA, as in a run
    ids = torch.randint(0, 200, (2, 5 * TINY_WINDOW + 3), device=dev)
    for got, want in zip(runner.hidden(ids), eager.hidden(ids)):
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.05


def test_the_shifted_convolution_is_transformers_causal_convolution():
    """targets/linear.py's shifted_conv, what a compiled Gated DeltaNet layer runs in place of transformers' F.conv1d
    fallback: the same causal depthwise convolution (bias or none, silu or none), eager and compiled, float32 to
    float32 rounding; bf16 in, bf16 out within one rounding; an activation it does not know is an error."""
    import torch.nn.functional as F

    from dflash.targets.linear import shifted_conv

    def reference(x, w, bias, activation):
        out = F.conv1d(x, w.unsqueeze(1), bias, padding=w.shape[-1] - 1, groups=x.shape[1])[..., : x.shape[-1]]
        return F.silu(out) if activation else out

    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((2, 24, 37), (24, 4), (24,)))
    compiled = torch.compile(shifted_conv, dynamic=True)
    for bias in (None, b):
        for activation in (None, "silu"):
            want = reference(x, w, bias, activation)
            torch.testing.assert_close(shifted_conv(x, w, bias, activation), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled(x, w, bias, activation), want, rtol=1e-5, atol=1e-5)
    got = shifted_conv(x.bfloat16(), w.bfloat16(), None, "silu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(x.bfloat16().float(), w.bfloat16().float(), None, "silu"),
                               rtol=2 ** -8, atol=1e-2)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        shifted_conv(x, w, None, "gelu")


def test_the_compiled_convolution_is_taken_only_for_what_it_does():
    """The convolution prepare installs runs its compiled form only while torch.compile traces a plain call (no
    packed rows, SiLU or no activation); packed rows (seq_idx, cu_seqlens) and other activations reach transformers'
    own function, compiled or not, and so does every eager call."""
    from dflash.targets.linear import PACKED, _conv_under_compile

    def eager(x, w, bias=None, activation=None, **kwargs):
        return x + 1

    def compiled(x, w, bias=None, activation=None, **kwargs):
        return x + 2

    conv = _conv_under_compile(eager, compiled)
    x, w = torch.zeros(1, 3, 5), torch.zeros(3, 4)
    cases = [({"activation": "silu"}, 2), ({"activation": None}, 2), ({"activation": "swish"}, 2),
             ({"activation": "relu"}, 1)] + [({"activation": "silu", k: torch.zeros(1, 5)}, 1) for k in PACKED]
    for kwargs, want in cases:
        assert float(conv(x, w, None, **kwargs).mean()) == 1  # eager: transformers' own
        got = torch.compile(lambda t, kw=kwargs: conv(t, w, None, **kw), dynamic=True)(x)
        assert float(got.mean()) == want, kwargs
    assert float(torch.compile(lambda t: conv(t, w, None, "relu"))(x).mean()) == 1  # positional activation


@pytest.mark.internals  # transformers' Gated DeltaNet module-level functions and dynamo's graph breaks
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_gated_deltanet_layers_compile_around_their_recurrent_kernel(arch, tiny_target, monkeypatch):  # noqa: F811
    """compile_layers on a target with Gated DeltaNet layers: each layer's recurrent kernel (the chunked delta rule:
    flash-linear-attention's Triton kernels on CUDA, whose tracing kept a Qwen3.6-27B-shaped layer compiling past
    130 s) runs outside the compiled graphs, called once a layer a forward as eager; the convolution inside them is
    shifted_conv; the model's hidden states are the eager layers' within float32 rounding; and an eager caller of
    the modeling file's convolution still gets transformers' own."""
    import sys

    from dflash.targets import linear
    from dflash.targets.adapter import text_model

    model = _load(tiny_target(arch))
    layers = text_model(model, "tiny").layers
    gdn = [m for m in model.modules() if linear.is_linear_attention(m)]
    assert gdn, f"the tiny {arch} has no Gated DeltaNet layer: this test checks nothing"
    mod = sys.modules[type(gdn[0]).__module__]
    chunk, conv = mod.torch_chunk_gated_delta_rule, mod.causal_conv1d_fn
    calls = {"chunk": [], "conv": []}  # per call, whether torch.compile was tracing it (a replayed side effect
    # of a traced call records True; a call outside the graphs, False)

    def counted_chunk(*args, **kwargs):
        calls["chunk"].append(torch.compiler.is_compiling())
        return chunk(*args, **kwargs)

    def counted_conv(*args, **kwargs):
        calls["conv"].append(torch.compiler.is_compiling())
        return conv(*args, **kwargs)

    for name in linear.RECURRENT:  # every name prepare wraps, so that the wrapping is undone after the test
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, getattr(mod, name))
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", counted_chunk)
    monkeypatch.setattr(mod, linear.CONV, counted_conv)
    monkeypatch.setattr(mod, linear._MARK, False, raising=False)  # prepared afresh, undone after the test
    ids = torch.randint(0, 200, (2, 45), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert calls == {"chunk": [False] * len(gdn), "conv": [False] * len(gdn)}, calls
    torch._dynamo.reset()
    kernels.compile_layers(layers)
    try:
        with torch.inference_mode():
            model(input_ids=ids, output_hidden_states=True)  # compiles
            calls.update(chunk=[], conv=[])
            got = model(input_ids=ids, output_hidden_states=True).hidden_states
        # the kernel outside the graphs, once a layer; the convolution shifted_conv inside them
        assert calls == {"chunk": [False] * len(gdn), "conv": []}, calls
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        x = torch.randn(1, gdn[0].conv_dim, 9)
        weight = gdn[0].conv1d.weight.squeeze(1)
        assert torch.equal(mod.causal_conv1d_fn(x, weight, None, activation="silu"),
                           conv(x, weight, None, activation="silu"))
        assert calls["conv"] == [False]  # transformers' own, called eager
    finally:
        kernels.compile_layers(layers, on=False)
        torch._dynamo.reset()


def test_compile_layers_auto_leaves_gated_deltanet_targets_eager(tiny_target, caplog):  # noqa: F811
    """--compile-layers auto (what a long GPU run asks for) leaves a target with Gated DeltaNet layers eager and says
    so: compiled whole, a Qwen3.6-27B-shaped command's start-up ran past 7 minutes on one H100, and compiled around
    the recurrent kernel (targets/linear.py) it is not yet measured faster on a GPU."""
    from dflash.targets.runner import TargetRunner

    with caplog.at_level(logging.INFO, logger="dflash"):
        runner = TargetRunner(_load(tiny_target("qwen3_5")), list(LAYERS), compile_layers="auto")
    assert not runner.kernels.compiled
    assert all(layer._compiled_call_impl is None for layer in runner.text.layers)
    assert "leaves a target with Gated DeltaNet layers eager" in caplog.text, caplog.text


def test_compile_layers_auto_compiles_the_layers_around_flex(tiny_target, caplog, monkeypatch):  # noqa: F811
    """--compile-layers auto compiles a target's layers on flex attention too (a gpt-oss-20b-shaped command over 1M
    tokens on one H100 ran 1.58x compiled, its start-up 27 s longer: bench/RESULTS.md), checked as any compiled
    layers are; a machine whose inductor cannot compile them runs them eager and the log says why."""
    from dflash.targets.runner import TargetRunner

    monkeypatch.setattr(kernels, "candidates", lambda model, kinds, device: [Kernels("flex_attention"),
                                                                             Kernels("eager")])
    torch._dynamo.reset()
    try:
        with caplog.at_level(logging.INFO, logger="dflash"):
            runner = TargetRunner(_load(tiny_target("qwen3")), [1, 3], compile_layers="auto", check_length=64)
    finally:
        torch._dynamo.reset()
    assert runner.kernels.attention == "flex_attention"
    assert "compiling the decoder layers" in caplog.text, caplog.text
    assert runner.kernels.compiled or "with its layers compiled: cannot run here" in caplog.text, caplog.text


def test_compile_layers_auto_compiles_long_gpu_runs_only(caplog):
    """--compile-layers auto: off on the CPU and for a GPU run under COMPILE_MIN_TOKENS tokens left (the compilation
    would not pay for itself; the log says so), "auto" for a longer GPU run (kernels.choose then leaves
    targets with Gated DeltaNet layers eager); on and off are taken as given."""
    from types import SimpleNamespace

    from dflash.extract.worker import COMPILE_MIN_TOKENS, compile_layers

    auto = SimpleNamespace(compile_layers="auto")
    assert compile_layers(auto, "cpu", 10**12) == "off"
    with caplog.at_level(logging.INFO, logger="dflash"):
        assert compile_layers(auto, "cuda:0", COMPILE_MIN_TOKENS - 1) == "off"
    assert "under --compile-layers auto's 10,000,000" in caplog.text
    assert compile_layers(auto, "cuda:1", COMPILE_MIN_TOKENS) == "auto"
    assert compile_layers(SimpleNamespace(compile_layers="on"), "cpu", 0) == "on"
    assert compile_layers(SimpleNamespace(compile_layers="off"), "cuda:0", 10**12) == "off"


@pytest.mark.internals  # torch.compile's specialisation of a size of 1, through transformers' compiled flex attention
def test_a_batch_of_one_row_on_flex_runs_as_two_and_compiles_nothing_new(tiny_target):  # noqa: F811
    """torch.compile specialises a size of 1, so a batch of one row compiled flex attention and its block mask again
    (a 1M-token gpt-oss-20b-shaped run on one H100 did so for both its mask kinds): the runner runs such a batch as
    the row twice, which the graphs compiled for larger batches take, and returns the row's features alone, those
    of the eager forward; the same row run alone (the control) compiles."""
    from dflash.targets.runner import TargetRunner

    gen = torch.Generator().manual_seed(5)
    model = _load(tiny_target("qwen3"))
    row = torch.randint(0, 200, (1, 70), generator=gen)
    runner = TargetRunner(model, [1, 3], check=False, warm_tokens=400)
    with torch.inference_mode():
        want = runner.hidden(row)  # the model's own attention (eager)
    torch._dynamo.reset()
    try:
        kernels.apply(model, Kernels("flex_attention"))
        runner.kernels = kernels.current(model)
        assert runner.kernels.attention == "flex_attention"
        for shape in ((2, 48), (3, 64)):  # compiled static, then again with dynamic sizes, as a run's first batches
            runner.hidden(torch.randint(0, 200, shape, generator=gen))
        graphs = kernels.graphs_compiled()
        assert graphs > 0
        got = runner.hidden(row)
        assert kernels.graphs_compiled() == graphs, "a batch of one row compiled flex attention again"
        assert [g.shape[0] for g in got] == [1, 1]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        runner.one_row_as_two = False
        runner.hidden(row)
        assert kernels.graphs_compiled() > graphs, "the control: the row alone compiles for a size of 1"
    finally:
        torch._dynamo.reset()


@pytest.mark.internals  # dynamo's setting of a first graph's sizes (assume_static_by_default), through choose
def test_flex_is_compiled_dynamic_from_its_first_call_on_cuda_only(tiny_target, monkeypatch):  # noqa: F811
    """The self-check makes torch.compile's first graphs dynamic before it tries flex attention, so that flex and its
    block masks compile once there for every batch shape of the run; only on CUDA (kernels.dynamic_first), where a
    gpt-oss-20b-shaped command compiled nothing after its start-up so; the CPU's compilation is left as it is."""
    from dflash.targets.adapter import text_model

    import torch.fx.experimental._config as shapes

    config = torch._dynamo.config  # a module of settings: monkeypatch would delete the setting on undo
    with config.patch(assume_static_by_default=True), shapes.patch(use_duck_shape=True):
        assert kernels.dynamic_first(torch.device("cpu")) is False
        assert config.assume_static_by_default is True and shapes.use_duck_shape is True
        assert kernels.dynamic_first(torch.device("cuda")) is True  # a device's name: no GPU needed to ask
        assert config.assume_static_by_default is False and shapes.use_duck_shape is False
    assert config.assume_static_by_default is True and shapes.use_duck_shape is True

    asked: list[tuple[str, int]] = []  # (device, graphs compiled by then): before flex's first compilation
    monkeypatch.setattr(kernels, "dynamic_first",
                        lambda device: asked.append((str(device), kernels.graphs_compiled())) or False)
    model = _load(tiny_target("qwen3"))
    ids = torch.randint(0, 200, (2, 40))
    for options, want in (([Kernels("sdpa"), Kernels("eager")], []),
                          ([Kernels("flex_attention"), Kernels("eager")], ["cpu"])):
        monkeypatch.setattr(kernels, "candidates", lambda model, kinds, device, o=options: o)
        torch._dynamo.reset()
        asked.clear()
        before = kernels.graphs_compiled()
        chosen, _, _ = kernels.choose(model, text_model(model), ids, [40, 33], [1, 3], ["full_attention"], "float32")
        assert chosen == options[0] and [d for d, _ in asked] == want
        assert all(graphs == before for _, graphs in asked), "asked after flex had compiled"
    assert kernels.graphs_compiled() > before  # flex did compile, after the ask
    # A runner of a target loaded on flex without the choice (a sharded one's) asks too.
    from dflash.targets.runner import TargetRunner

    asked.clear()
    kernels.apply(model, Kernels("flex_attention"))
    TargetRunner(model, [1, 3], check=False)
    assert [d for d, _ in asked] == ["cpu"]
    torch._dynamo.reset()


@pytest.mark.internals  # dynamo's first-graph settings and duck sizing, through torch.compile's flex attention
def test_flex_compiled_under_dynamic_first_takes_every_later_batch_shape():
    """Under kernels.dynamic_first's settings, applied here on the CPU, flex attention compiled (as transformers
    compiles it: torch.compile with torch's defaults) on the check's 2 rows of 160 tokens (two of flex's 128-token
    blocks, a sliding window of 128; 2 query heads, 1 key/value head, as the tiny gpt_oss) takes batches of other
    shapes without compiling again, with the eager kernel's output. The controls: with duck sizing on (the 2 rows share
    the symbol of another 2, the heads or the block count, which a later batch breaks: the tiny gpt_oss on one H100,
    bench/RESULTS.md) and with torch's default, it compiles again. (transformers' own flex forward on the CPU does not
    compile with every size symbolic, duck sizing on or off: a C++ template error of inductor's in torch 2.13, so the
    CPU keeps torch's default.)"""
    import torch.fx.experimental._config as shapes
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def window(b, h, q, k):
        return (q >= k) & (q - k < 128)

    gen = torch.Generator().manual_seed(9)
    shapes_run = ((2, 160), (8, 300), (3, 517), (5, 129))
    inputs = [[torch.randn(b, h, n, 16, generator=gen) for h in (2, 1, 1)] for b, n in shapes_run]
    compiled = {}
    try:
        for arm, duck in (("dynamic first", False), ("duck sizing on", True), ("torch's default", True)):
            torch._dynamo.reset()
            with torch._dynamo.config.patch(assume_static_by_default=True), shapes.patch(use_duck_shape=True):
                if arm != "torch's default":
                    assert kernels.dynamic_first("cuda")  # the settings CUDA gets, on the CPU's inductor
                if arm == "duck sizing on":
                    shapes.use_duck_shape = True
                assert shapes.use_duck_shape is duck
                flex = torch.compile(flex_attention)
                outs = []
                for n, (q, k, v) in enumerate(inputs):
                    mask = create_block_mask(window, q.shape[0], None, q.shape[2], k.shape[2], device="cpu")
                    with torch.inference_mode():
                        outs.append(flex(q, k, v, block_mask=mask, enable_gqa=True))
                    if n == 0:
                        graphs = kernels.graphs_compiled()
                compiled[arm] = kernels.graphs_compiled() - graphs
            if arm == "dynamic first":
                for (q, k, v), out in zip(inputs, outs):
                    n = q.shape[2]
                    allowed = torch.ones(n, n).tril().bool() & ~torch.ones(n, n).tril(-128).bool()
                    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                                            enable_gqa=True)
                    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    finally:
        torch._dynamo.reset()
    assert compiled["dynamic first"] == 0 and compiled["duck sizing on"] > 0 and compiled["torch's default"] > 0, \
        compiled


@pytest.mark.gpu
def test_on_cuda_flex_compiles_at_the_start_up_check_for_every_batch_shape(tiny_target, tmp_path,  # noqa: F811
                                                                           monkeypatch):
    """On CUDA the runner on flex attention (the tiny gpt_oss with gpt-oss-20b's window of 128: sinks, sliding and
    full layers, a check of 2 rows of 160 tokens, two of flex's blocks) compiles nothing after its start-up check
    over batches of other shapes; the control, flex's first graphs static as torch's default, compiles again."""
    import shutil

    from dflash.targets.load import load_for_features
    from dflash.targets.runner import TargetRunner

    folder = shutil.copytree(tiny_target("gpt_oss"), tmp_path / "gpt_oss")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 128}))
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    # Past flex's 128-token blocks, as a run's batches and the check's rows (160 tokens for gpt-oss-20b) are.
    shapes = ((8, 300), (3, 517), (5, 129), (2, 1000))
    compiled = {}
    for arm in ("dynamic first", "static first"):
        if arm == "static first":
            monkeypatch.setattr(kernels, "dynamic_first", lambda device: False)
        torch._dynamo.reset()
        with torch._dynamo.config.patch(assume_static_by_default=True):  # torch's default, restored after the arm
            model = load_for_features(folder, dev, torch.bfloat16)
            runner = TargetRunner(model, list(LAYERS), warm_tokens=1 << 14)
            assert runner.kernels.attention == "flex_attention"
            graphs = kernels.graphs_compiled()
            for shape in shapes:
                runner.hidden(torch.randint(0, 200, shape, generator=gen).to(dev))
            compiled[arm] = kernels.graphs_compiled() - graphs
        del runner, model
    torch._dynamo.reset()
    assert compiled["dynamic first"] == 0 and compiled["static first"] > 0, compiled


class _Rows:
    """A forward pre-hook on the first decoder layer recording each forward's (rows, length), and raising `error`
    for a batch of two rows of `limit` tokens or more, as a device that holds no more would."""

    def __init__(self, runner, error: BaseException | None = None, limit: int = 1 << 30) -> None:
        self.seen: list[tuple[int, int]] = []
        self.error, self.limit = error, limit
        self.handle = runner.text.layers[0].register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.seen.append(tuple(hidden.shape[:2]))
        if self.error is not None and hidden.shape[0] == 2 and hidden.shape[1] >= self.limit:
            raise self.error


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes"),
])
def test_a_row_that_does_not_fit_twice_runs_alone_and_so_do_later_rows(error, tiny_target, caplog):  # noqa: F811
    """A long row alone may fit where two copies do not: the doubled batch's out-of-memory error (raised here by the
    first decoder layer for a batch of two rows, as a GPU's or the CPU allocator's would be; this box has memory
    enough) leaves that row to run alone, with its features those of the forward; flex has then compiled for a size
    of 1, so later rows of one run alone too."""
    from dflash.targets.runner import TargetRunner

    gen = torch.Generator().manual_seed(6)
    model = _load(tiny_target("qwen3"))
    runner = TargetRunner(model, [1, 3], check=False, warm_tokens=400)
    rows = {n: torch.randint(0, 200, (1, n), generator=gen) for n in (40, 70, 80)}
    with torch.inference_mode():
        want = {n: runner.hidden(ids) for n, ids in rows.items()}  # the model's own attention: rows run once
    runner.kernels = Kernels("flex_attention")  # what the doubling keys on; the forward itself stays eager here
    hook = _Rows(runner, error, limit=70)
    with caplog.at_level(logging.INFO, logger="dflash.targets.runner"):
        got = {n: runner.hidden(rows[n]) for n in (40, 70, 80, 40)}
    hook.handle.remove()
    assert hook.seen == [(2, 40), (2, 70), (1, 70), (1, 80), (1, 40)]
    assert "a row of 70 tokens did not fit in memory twice" in caplog.text
    for n, feats in got.items():
        assert [f.shape[0] for f in feats] == [1, 1]
        for g, w in zip(feats, want[n]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_rows_of_one_run_twice_only_while_cheaper_than_the_compilation(tiny_target, monkeypatch):  # noqa: F811
    """A row runs twice only where two copies fit a batch of the run (warm_tokens; none without one) and while the
    copies' forward time is under the runner's rent; after that (or after a row too long to run twice) every row
    of one runs alone: flex compiles once for a size of 1, as before, and a long run pays at most the rent."""
    import dflash.targets.runner as runner_module
    from dflash.targets.runner import TargetRunner

    model = _load(tiny_target("qwen3"))

    def rows_seen(warm_tokens: int, lengths: list[int]) -> list[tuple[int, int]]:
        runner = TargetRunner(model, [1, 3], check=False, warm_tokens=warm_tokens)
        runner.kernels = Kernels("flex_attention")
        hook = _Rows(runner)
        for n in lengths:
            runner.hidden(torch.randint(0, 200, (1, n)))
        hook.handle.remove()
        return hook.seen

    assert rows_seen(0, [40, 40]) == [(1, 40), (1, 40)]  # no batch size known (the CPU's runs): never twice
    assert rows_seen(100, [60, 40]) == [(1, 60), (1, 40)]  # 2 x 60 > 100: alone, and so is every later row
    assert rows_seen(100, [40, 50, 30]) == [(2, 40), (2, 50), (2, 30)]  # the copies' cost is far under the rent
    monkeypatch.setattr(runner_module, "ONE_ROW_RENT_S", 1e-9)  # the first copy pays it all
    assert rows_seen(100, [40, 50, 30]) == [(2, 40), (1, 50), (1, 30)]


@pytest.mark.internals  # torch.compile's counter of graphs (kernels.graphs_compiled)
def test_a_doubled_row_that_compiled_counts_no_rent(tiny_target):  # noqa: F811
    """A doubled row whose forward compiled (a run's first batch: flex's first graphs or its dynamic ones) pays no
    rent for it, since any batch there would have compiled; a doubled row after that does."""
    from dflash.targets.runner import TargetRunner

    model = _load(tiny_target("qwen3"))
    runner = TargetRunner(model, [1, 3], check=False, warm_tokens=400)
    torch._dynamo.reset()
    try:
        kernels.apply(model, Kernels("flex_attention"))
        runner.kernels = kernels.current(model)
        graphs = kernels.graphs_compiled()
        runner.hidden(torch.randint(0, 200, (1, 70)))
        assert kernels.graphs_compiled() > graphs and runner._paid() == 0.0
        runner.hidden(torch.randint(0, 200, (3, 64)))  # dynamic sizes from here on
        graphs = kernels.graphs_compiled()
        runner.hidden(torch.randint(0, 200, (1, 50)))
        assert kernels.graphs_compiled() == graphs and runner._paid() > 0.0
    finally:
        torch._dynamo.reset()


def test_a_doubled_row_that_fails_otherwise_is_not_taken_for_memory(tiny_target):  # noqa: F811
    """Only an allocation that failed sends a row to run alone: any other error of the doubled batch is the run's."""
    from dflash.targets.runner import TargetRunner

    runner = TargetRunner(_load(tiny_target("qwen3")), [1, 3], check=False, warm_tokens=400)
    runner.kernels = Kernels("flex_attention")
    hook = _Rows(runner, ValueError("a kernel's own failure"), limit=0)
    with pytest.raises(ValueError, match="a kernel's own failure"):
        runner.hidden(torch.randint(0, 200, (1, 40)))
    hook.handle.remove()
    assert hook.seen == [(2, 40)]
    assert runner._twice_max == 200  # still runs rows twice
