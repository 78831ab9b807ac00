"""Which attention and experts kernels run the target, chosen per target and device and checked against the
model's own eager float32 forward: the fastest exact path for every layer kind.

Candidates come from what transformers offers (`attn_implementation`, `experts_implementation`), never a Hub
kernel (`use_kernels` stays off): on Hopper and later dflash's cuDNN attention (targets/attention.py) where the
query-key and value head dims differ (MLA), on CUDA flash_attention_2 where flash-attn is installed and the model
runs SDPA, flex_attention for sliding windows and attention sinks (its block mask skips what a window hides; the
sinks enter its softmax through the log-sum-exp), SDPA, then eager; for the experts on CUDA dflash's forward-only
grouped GEMMs (targets/experts.py), then transformers' grouped GEMMs, then its loop over experts. On the CPU flex
does not take sinks, so there it is SDPA where the model supports it, else eager, and transformers' own experts.

The check (`choose`) runs the full model once in float32 with eager attention and experts (each decoder layer
upcast in turn, so the check needs one layer's float32 copy, not the model's), then each candidate in the run's
dtype, in order, and keeps the first whose layers' updates differ from that reference's by no more than the
dtype's rounding (relative_error): within `TOLERANCE`, or within twice the eager kernels' own in the same dtype (a
deep bf16 stack drifts from float32 by itself). A candidate that differs more, or fails to run, is logged
and the next one is tried; eager is the model's own forward and always last.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["Kernels", "TOLERANCE", "has_experts", "current", "attention_order", "experts_order", "candidates", "apply",
           "model_states", "eager_float32_states", "captured", "relative_error", "choose", "attention_backends",
           "accepts", "compile_layers", "graphs_compiled", "dynamic_first", "first_line"]

log = logging.getLogger(__name__)


def attention_backends(device: torch.device, cudnn: bool = False) -> Any:
    """Return a context in which SDPA may pick any kernel but cuDNN's on CUDA (unless cudnn), else no context.

    On Hopper torch prefers cuDNN's attention, which builds and caches an execution plan for each new (batch, length)
    shape. Extraction's batches are packed to their samples' lengths, so nearly every batch is a new shape: on one
    H200 a first pass over a short real run's 163 batches took 23.0 s against 15.1 s for a second pass over the same
    batches, and leaving cuDNN out took the command from 21,775 to 29,693 tok/s (bench/RESULTS.md, issue 22). Flash
    and memory-efficient attention keep no per-shape state. cuDNN's kernel is faster once planned: targets/attention.py
    (its own candidate, for MLA's head dims) calls it on lengths rounded up, so that its plans are few.
    The flags it sets are torch's process-wide ones, restored on exit: in extract only the forward's thread runs SDPA.
    """
    if device.type != "cuda" or cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def accepts(model: Any, name: str) -> bool:
    """Return True if the model's forward takes the keyword `name`."""
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False

# The largest difference a kernel may show against the eager float32 forward in what a decoder layer adds to the
# residual stream (relative_error), by the dtype the run computes in. float32 kernels agree to ~1e-6;
# one bf16 rounding is 2**-9 relative, and a layer's update comes out of a residual stream it may be small beside,
# so bf16 is allowed 2e-2, or twice what the model's own eager kernels show in bf16 where that is more. A kernel
# that loses a window, the sinks or the routing weights changes the updates of every token it touches: tens of %.
TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}


def first_line(e: BaseException) -> str:
    """Return an exception's first line, at most 200 characters (what a one-line log message quotes of it)."""
    return str(e).splitlines()[0][:200] if str(e) else ""


@dataclass(frozen=True)
class Kernels:
    """The attention implementation and the experts implementation (None: the target has no experts) a target
    runs with."""

    attention: str
    experts: str | None = None
    compiled: bool = False  # every decoder layer under torch.compile (compile_layers)

    def to_dict(self) -> dict[str, str | bool | None]:
        return {"attention": self.attention, "experts": self.experts, "compiled": self.compiled}

    def __str__(self) -> str:
        return (f"attention {self.attention}" + (f", experts {self.experts}" if self.experts else "")
                + (", layers compiled" if self.compiled else ""))


def has_experts(model: Any) -> bool:
    """Return True if the model has mixture-of-experts layers whose implementation transformers can switch."""
    # transformers' use_experts_implementation decorator gives every experts module these attributes.
    return any(hasattr(m, "is_concatenated") and hasattr(m, "has_gate") for m in model.modules())


def current(model: Any) -> Kernels:
    """Return the kernels the model runs with now (what its config says)."""
    cfg = model.config
    if not has_experts(model):
        return Kernels(str(cfg._attn_implementation))
    # None: transformers' default, grouped GEMMs
    return Kernels(str(cfg._attn_implementation), getattr(cfg, "_experts_implementation", None) or "grouped_mm")


def _flash_attn_installed() -> bool:
    from importlib import util

    return util.find_spec("flash_attn") is not None


def attention_order(owner: Any, kinds: list[str], device: Any, config: Any = None) -> list[str]:
    """Return the attention implementations to try for a model class (or model) on a device, fastest first,
    eager last. kinds: the layer kinds it runs (adapter.layer_kinds); config: its config (a model's own by default).

    A model that does not run SDPA has attention SDPA cannot take (gpt-oss: sinks): flash-attn, which has no
    sinks either, is not tried there; flex is, since its softmax takes the sinks through its log-sum-exp on CUDA.
    Full attention stays on SDPA (its flash kernel, no mask at all), windows go to flex, whose block mask skips what
    they hide (SDPA is handed a dense mask and computes every pair). Where the query-key and value head dims differ
    (MLA), which flash does not take, cuDNN's kernel comes first on Hopper and later (targets/attention.py: 4.1x the
    memory-efficient kernel SDPA runs there, on one H100); where flash runs, cuDNN's plans for new shapes cost more
    than its faster kernel saved (a Qwen3-30B-A3B-shaped command, bench/RESULTS.md).
    """
    import torch

    from . import attention
    from .adapter import unequal_head_dims

    cuda = torch.device(device).type == "cuda"
    sdpa = bool(getattr(owner, "_supports_sdpa", False))
    flex = bool(getattr(owner, "_supports_flex_attn", False))
    flash = bool(getattr(owner, "_supports_flash_attn", False))
    config = config if config is not None else getattr(owner, "config", None)
    order: list[str] = []
    if cuda and sdpa and config is not None and unequal_head_dims(config) and attention.usable(device):
        order.append(attention.NAME)
    if cuda and sdpa and flash and _flash_attn_installed():
        order.append("flash_attention_2")
    if cuda and flex and ("sliding_attention" in kinds or not sdpa):
        order.append("flex_attention")
    if sdpa:
        order.append("sdpa")
    return order + ["eager"]


def experts_order(device: Any) -> list[str]:
    """Return the experts implementations to try on a device, fastest first, eager last: on CUDA dflash's own
    forward-only grouped GEMMs first (targets/experts.py: 1.28x transformers' grouped_mm on a Qwen3-30B-A3B-shaped
    forward, one H100 with transformers 5.17, bench/RESULTS.md), then transformers' grouped GEMMs and its loop."""
    import torch

    from . import experts

    own = [experts.NAME] if torch.device(device).type == "cuda" and experts.register() else []
    return own + ["grouped_mm", "eager"]


def candidates(model: Any, kinds: list[str], device: Any) -> list[Kernels]:
    """Return the kernels to try for a loaded target on a device, fastest first (attention_order, each with
    experts_order); the last is eager attention and experts."""
    experts = experts_order(device) if has_experts(model) else [None]
    return [Kernels(a, e) for a in attention_order(model, kinds, device) for e in experts]


def apply(model: Any, kernels: Kernels) -> None:
    """Switch the model to the kernels (transformers' set_attn_implementation / set_experts_implementation);
    ValueError or ImportError when this model or machine cannot run them."""
    from . import attention

    now = current(model)
    if kernels.attention == attention.NAME:
        attention.register()
    if now.attention != kernels.attention:
        model.set_attn_implementation(kernels.attention)
    if kernels.experts is not None and now.experts != kernels.experts:
        model.set_experts_implementation(kernels.experts)


def compile_layers(layers: Any, on: bool = True) -> None:
    """Run every decoder layer under torch.compile (on), or eager again (off).

    One layer's code, compiled once with dynamic shapes (batch and length vary from batch to batch) and shared by the
    layers of its kind: torch inlines the module, its weights are the graph's inputs. Inductor fuses the elementwise
    passes between the GEMMs (RMSNorm, rotary, gates, routing weights), which take most of an MoE layer's time: on
    one H100 a Qwen3-30B-A3B-shaped forward ran 50,872 tok/s compiled against 31,380 (1.62x; bench/RESULTS.md,
    2026-12-05). torch's limit of compiled variants per function is raised so that a target whose layers differ
    (windows, sinks, captured or not) never falls back to eager after the eighth.

    transformers' output-capturing hooks on a layer's parts (its attention's, its router's: output_attentions and
    output_router_logits, which extract never asks for) read a ContextVar that torch cannot trace, so each split
    the compiled layer, and the calls around them became frames of their own: a Qwen3-MoE layer compiled to 7
    graphs. They are removed before compiling (the layer's own hook, which output_hidden_states and the self-check
    read, stays), and the layer compiles to one graph: the compiled forward of a small Qwen3-MoE stack ran 1.74x
    faster on the CPU (bench/RESULTS.md, 2026-12-06). A Gated DeltaNet layer compiles around its recurrent kernel
    (targets/linear.py), which runs as it does eager.
    """
    import torch

    if on:
        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(config, name):
                setattr(config, name, max(int(getattr(config, name)), 64))
    from . import linear

    for layer in layers:
        layer._compiled_call_impl = None
        if on:
            _drop_output_capture(layer)
            linear.prepare(layer)  # Gated DeltaNet layers compile around their recurrent kernel
            layer.compile(dynamic=True)


def dynamic_first(device: Any) -> bool:
    """On CUDA, make torch.compile take every size as symbolic from a function's first graph, each size a symbol of
    its own (dynamo's assume_static_by_default and the shape environment's duck sizing off: for the process on torch
    2.11, for the calling thread from torch 2.12 on, which keeps dynamo's settings per thread; extract builds its
    runner and runs every forward on one thread), and return whether it did; the CPU is left as it is.

    transformers compiles flex attention and its block masks with torch's default, a first graph static at the
    self-check's 2 rows and a second, dynamic, at the first batch of another shape: in a 1M-token gpt-oss-20b-shaped
    command on one H100 that second round (both mask kinds' flex and block mask) took the run's first batch 21 s.
    Dynamic from the first call, both are compiled at the self-check and the batches of two rows or more take them
    (rows of one break a size-1 guard: targets/runner.py runs them as two while cheaper): the same command compiled
    nothing after its start-up and ran 1.53x (bench/RESULTS.md, 2026-12-07). Duck sizing gives sizes of equal value
    one symbol: the check's 2 rows took the symbol of any other 2 in the call (2 query heads, a constant, which
    made the keys static: the tiny gpt_oss on one H100 compiled flex again for its first batch; 2 blocks of 128
    tokens in the check's rows of 160, so that a later batch's rows had to equal its block count), so each size gets
    its own. Both settings reach every later compile on the thread: a first graph compiled with torch's default, and
    graphs that ask for dynamic shapes (compiled decoder layers) lose duck sizing; static ones (the drafter's
    attention) do not change. On the CPU torch.compile's flex alone compiles once with both off
    too (tests/test_kernels.py), but inductor's C++ template fails on transformers' flex forward with every size
    symbolic (torch 2.13), so the CPU keeps torch's default."""
    if getattr(device, "type", device) != "cuda":
        return False
    import torch
    import torch.fx.experimental._config as shapes

    torch._dynamo.config.assume_static_by_default = False
    shapes.use_duck_shape = False
    return True


def graphs_compiled() -> int:
    """Return how many graphs torch.compile has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# The module of transformers' output-capturing hooks (output_hidden_states, output_attentions, output_router_logits)
OUTPUT_CAPTURE_MODULE = "transformers.utils.output_capturing"


def _drop_output_capture(layer: Any) -> None:
    """Remove transformers' output-capturing forward hooks from a decoder layer's submodules (not from the layer)."""
    for sub in layer.modules():
        if sub is not layer:
            hooks = sub._forward_hooks
            for key in [k for k, h in hooks.items() if getattr(h, "__module__", None) == OUTPUT_CAPTURE_MODULE]:
                del hooks[key]


@contextlib.contextmanager
def _upcast(model: Any, layers: Any) -> Iterator[None]:
    """Run every module in float32 while it runs, and in its own dtype again after: each decoder layer whole (its
    parts may read each other's weights), every other module by its own parameters and buffers.

    bf16 -> float32 -> bf16 is exact, so the weights come back bit for bit; at most one layer is float32 at a time,
    and the embedding and the head never are.
    """
    import torch

    cast: dict[int, Any] = {}  # id(tensor holder) -> its original data, while upcast

    def up(tensors: list[Any]) -> list[Any]:
        done = []
        for t in tensors:
            if t is not None and t.is_floating_point() and t.dtype != torch.float32 and id(t) not in cast:
                cast[id(t)] = t.data
                t.data = t.data.float()
                done.append(t)
        return done

    def hooks(module: Any, own: bool) -> list[Any]:
        stack: list[list[Any]] = []

        def pre(m: Any, args: Any) -> None:
            stack.append(up(list(m.parameters(recurse=not own)) + list(m.buffers(recurse=not own))))

        def post(m: Any, args: Any, out: Any) -> None:
            for t in stack.pop():
                t.data = cast.pop(id(t))

        # The restore runs before any other forward hook of the module: a layer streamed from host memory
        # (targets/streamed.py) is bound to its device slot by a pre-hook registered before this one and given back
        # by a forward hook, which must find its own weights restored, not the upcast copies.
        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, prepend=True)]

    # The vocabulary-sized matrices need no float32 copy (V x H x 4 bytes each, the largest of the check: 1.2 GiB
    # apiece for a 152K x 2,048 target): a plain embedding's rows are exact in float32 once looked up, and the head's
    # logits are not part of the hidden states compared, so it runs in its own dtype.
    def lookup_then_float(m: Any, args: Any, out: Any) -> Any:
        return out.float()

    def head_in_own_dtype(m: Any, args: Any) -> Any:
        return (args[0].to(m.weight.dtype), *args[1:]) if args else None

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inside = {id(m) for layer in layers for m in layer.modules()}
    handles = [h for layer in layers for h in hooks(layer, own=False)]
    for m in model.modules():
        if id(m) in inside or m is model:
            continue
        if type(m) is torch.nn.Embedding:
            handles.append(m.register_forward_hook(lookup_then_float))
        elif m is head and isinstance(m, torch.nn.Linear):
            handles.append(m.register_forward_pre_hook(head_in_own_dtype))
        else:
            handles += hooks(m, own=True)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for t in [t for t in list(model.parameters()) + list(model.buffers()) if id(t) in cast]:
            t.data = cast.pop(id(t))  # a forward that failed half-way: every weight back in its own dtype


def model_states(model: Any, ids: Any, depth: int, lengths: list[int]) -> list[Any]:
    """Return, per row, the full model's output_hidden_states 0..depth (the embeddings, then every decoder
    layer's output up to the deepest run) on its real tokens [depth + 1, n, H]."""
    import torch

    kwargs = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    with torch.no_grad(), attention_backends(ids.device):
        states = model(input_ids=ids, use_cache=False, output_hidden_states=True, **kwargs).hidden_states
        return [torch.stack([states[j][b, :n] for j in range(depth + 1)]) for b, n in enumerate(lengths)]


def captured(states: list[Any], layer_ids: list[int]) -> list[Any]:
    """Return model_states' rows cut to the captured layers' outputs [len(layer_ids), n, H] (layer i: state i + 1)."""
    return [s[[i + 1 for i in layer_ids]] for s in states]


def eager_float32_states(model: Any, text: Any, ids: Any, depth: int, lengths: list[int]) -> list[Any]:
    """Return the model's own eager float32 forward on the rows (as model_states), whatever dtype it is loaded in; the
    model is left in eager kernels."""
    apply(model, Kernels("eager", "eager" if has_experts(model) else None))
    with _upcast(model, text.layers):
        return [s.float() for s in model_states(model, ids, depth, lengths)]


def relative_error(got: list[Any], want: list[Any]) -> tuple[float, int, int]:
    """Return how far what each decoder layer adds to the residual stream (its output minus its input) differs
    between `got` and `want`: per layer and row, the 90th percentile over tokens of each token's difference over
    the row's RMS update; the largest over layers and rows, with the layer and row where it is.

    A layer's own update, not its output: the residual stream can dwarf it (a routing that ignored its weights
    moved a tiny MoE target's layer outputs by 1e-3, their updates by tens of percent). A percentile, not the
    mean: a token whose top-k experts tie within rounding is routed otherwise in another dtype or kernel, and
    changes its own update wholly; a kernel that is wrong changes every token it touches (every token past a
    window: the check's first row is longer than the window by a fifth at least).
    """
    import torch

    worst = (0.0, 0, 0)
    for b, (g, w) in enumerate(zip(got, want)):
        g, w = g.float(), w.float()
        for j in range(g.shape[0] - 1):
            ref = w[j + 1] - w[j]
            scale = ref.norm(dim=-1).pow(2).mean().sqrt() + 1e-12
            per_token = ((g[j + 1] - g[j]) - ref).norm(dim=-1) / scale
            err = float(torch.quantile(per_token, 0.9)) if per_token.numel() > 1 else float(per_token.max())
            if not err <= worst[0]:  # NaN counts as the worst
                worst = (err, j, b)
    return worst


def choose(model: Any, text: Any, ids: Any, lengths: list[int], layer_ids: list[int], kinds: list[str],
           dtype: str, compile: str = "off",
           warm: tuple[int, int] | None = None) -> tuple[Kernels, list[Any], list[Any] | None]:
    """Return the first candidate kernels whose forward equals the eager float32 forward within the dtype's
    rounding (the model is left running them), that forward's captured states on the rows (what the truncated
    runner is then checked against), and where its layers are compiled the same kernels' captured states with the
    layers eager (the runner's check if it must leave them eager), else None. Logs the choice, and every candidate
    it passed over and why.
    compile: "on", then the same with every decoder layer compiled (compile_layers), held to the same bound; where
    it fails to compile or differs more, the layers run eager again and a warning says why; "auto", the same unless
    the target has Gated DeltaNet layers (compiled whole, flash-linear-attention's kernels traced with them, a
    Qwen3.6-27B-shaped start-up ran past 7 minutes on one H100; they now compile around those kernels,
    targets/linear.py, not yet measured on a GPU); layers around flex
    attention compile too (a gpt-oss-20b-shaped command over 1M tokens on one H100: 64,448 tok/s compiled against
    40,692 eager, its start-up 27 s longer, so even down to about 3M tokens); "off", never. warm: the
    (rows, length) of a batch of the run's size, the compiled layers' first call (warm_forward)."""
    depth = max(layer_ids) + 1
    rows = f"{len(lengths)} rows of up to {max(lengths)} tokens"
    options = candidates(model, kinds, ids.device)
    against = "the model's eager float32 forward"
    try:
        ref = eager_float32_states(model, text, ids, depth, lengths)
    except Exception as e:  # noqa: BLE001 - e.g. a layer too large to upcast on this device: the dtype's own eager
        against = f"the model's eager {dtype} forward"
        log.warning("the eager float32 reference cannot run here (%s: %s): kernels are checked against %s instead",
                    type(e).__name__, first_line(e), against)
        apply(model, options[-1])
        ref = model_states(model, ids, depth, lengths)
    tol = TOLERANCE.get(dtype, TOLERANCE["bfloat16"])
    eager_err: float | None = None

    def drift(k: Kernels) -> float:
        """How far the model's own eager kernels drift from the reference in this dtype (the rounding to allow),
        measured once; the model is left running k."""
        nonlocal eager_err
        if eager_err is None:
            apply(model, options[-1])
            eager_err = relative_error(model_states(model, ids, depth, lengths), ref)[0]
            apply(model, k)
        return eager_err

    def allowed(k: Kernels) -> float:
        """The largest difference a candidate may show in this dtype: the tolerance, or twice the eager drift."""
        return tol if dtype == "float32" else max(tol, 2 * drift(k))

    for n, k in enumerate(options):
        last = n == len(options) - 1
        try:
            if k.attention == "flex_attention":  # its first compilation serves every batch shape of the run
                dynamic_first(ids.device)
            apply(model, k)
            got = model_states(model, ids, depth, lengths)
        except Exception as e:  # noqa: BLE001 - a kernel this model, machine or shape cannot run: the next one
            log.warning("%s: cannot run here (%s: %s); trying %s", k, type(e).__name__,
                        first_line(e), options[n + 1] if not last else "nothing")
            if last:
                raise
            continue
        err, layer, row = relative_error(got, ref)
        bound = tol if err <= tol or last else allowed(k)
        if err <= bound or last:
            eager = None
            if compile == "auto" and "linear_attention" in kinds:
                log.info("decoder layers run eager: --compile-layers auto leaves a target with Gated DeltaNet layers "
                         "eager (not yet measured faster on a GPU); --compile-layers on compiles them around their "
                         "recurrent kernel")
            elif compile in ("on", "auto"):
                eager = captured(got, layer_ids)
                k, got, err = _compiled(model, text, ids, lengths, depth, ref, k, got, err, allowed(k), against,
                                        dtype, warm)
            log.info("kernels: %s (checked against %s on %s: each layer's update within %.2g of it, 90th "
                     "percentile token over the RMS)", k, against, rows, err)
            return k, captured(got, layer_ids), eager if k.compiled else None
        log.warning("%s: differs from %s by %.3g (layer %d's update, row %d, 90th percentile token over the RMS; "
                    "%s rounding allows %.2g): not used; trying %s", k, against, err, layer, row, dtype, bound,
                    options[n + 1])
    raise AssertionError("the last candidate is always taken")  # pragma: no cover


def _compiled(model: Any, text: Any, ids: Any, lengths: list[int], depth: int, ref: list[Any], k: Kernels,
              got: list[Any], err: float, bound: float, against: str, dtype: str,
              warm: tuple[int, int] | None = None) -> tuple[Kernels, list[Any], float]:
    """Return (kernels, states, error) with the decoder layers compiled where that forward is within bound of the
    reference, else the eager layers' (k, got, err) with a warning that says why. warm: the compiled layers' first
    call is a batch of that (rows, length), warm_forward."""
    import time

    from dataclasses import replace

    import torch

    t0 = time.perf_counter()
    log.info("compiling the decoder layers (torch.compile, dynamic shapes%s): seconds on the CPU's tiny targets, a "
             "minute or more for a large target on a GPU", f", first on {warm[0]} x {warm[1]} tokens" if warm else "")
    try:
        compile_layers(text.layers)
        # in the grad mode the runner's forwards run in (inference mode), so that they reuse what compiles here
        with torch.inference_mode():
            if warm is not None:
                warm_forward(text, warm)
            states = layer_states(text, ids, depth, lengths)
    except Exception as e:  # noqa: BLE001 - a layer torch cannot compile on this machine: the eager layers
        compile_layers(text.layers, on=False)
        log.warning("%s with its layers compiled: cannot run here (%s: %s); its layers run eager", k,
                    type(e).__name__, first_line(e))
        return k, got, err
    c_err, layer, row = relative_error(states, ref)
    if not c_err <= bound:
        compile_layers(text.layers, on=False)
        log.warning("%s with its layers compiled: differs from %s by %.3g (layer %d's update, row %d, 90th percentile "
                    "token over the RMS; %s rounding allows %.2g): its layers run eager", k, against, c_err, layer,
                    row, dtype, bound)
        return k, got, err
    log.info("decoder layers compiled in %.1f s (torch.compile, dynamic shapes%s; each new kind of batch may compile "
             "once more on the first batches)", time.perf_counter() - t0,
             f", first on {warm[0]} x {warm[1]} tokens" if warm else "")
    return replace(k, compiled=True), states, c_err


def layer_states(text: Any, ids: Any, depth: int, lengths: list[int]) -> list[Any]:
    """Return model_states' rows (the first layer's input, then each decoder layer's output up to the deepest run)
    from the text model called as the runner and warm_forward call it, the layers' outputs taken by forward hooks.

    Compiled layers compile once for each set of arguments they are called with: the full model asked for
    output_hidden_states passes its layers two more than the runner does, so its states would come from graphs of
    their own, compiled with the check's 2 rows as inductor's size hints, where the run's graphs take the warm
    batch's. On one H100 the two roundings moved a tied routing of a Qwen3-30B-A3B-shaped layer by 2.6% of its
    scale and the runner's check refused the target; here the check and the run share their graphs."""
    import torch

    taken: dict[int, Any] = {}

    @torch.compiler.disable  # run as Python: torch would compile each hook once for every length of `taken`
    def first_input(module: Any, args: Any, kwargs: dict) -> None:
        taken[0] = args[0] if args else kwargs["hidden_states"]

    def output(j: int) -> Any:
        @torch.compiler.disable
        def hook(module: Any, args: Any, out: Any) -> None:
            taken[j + 1] = out[0] if isinstance(out, tuple) else out

        return hook

    hooks = [text.layers[0].register_forward_pre_hook(first_input, with_kwargs=True)]
    hooks += [text.layers[j].register_forward_hook(output(j)) for j in range(depth)]
    try:
        with torch.no_grad(), attention_backends(ids.device):
            text(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [torch.stack([taken[j][b, :n] for j in range(depth + 1)]) for b, n in enumerate(lengths)]


def warm_forward(text: Any, shape: tuple[int, int]) -> None:
    """Run the text model on random token ids of shape (rows, length), the compiled layers' first call where the run
    gives it a batch of its own size: torch.compile with dynamic shapes still takes its sizes as inductor's hints
    (each kernel's size class and candidate configurations), and Triton tunes each kernel at its first launch, so a
    first call on the self-check's 2 rows of ~96 tokens would leave every layer's kernels chosen for a batch a
    hundred times smaller than the run's."""
    import torch

    emb = text.embed_tokens.weight
    ids = torch.randint(0, emb.shape[0], shape, device=emb.device)
    with attention_backends(emb.device):
        text(input_ids=ids, use_cache=False)
