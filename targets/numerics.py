"""Which dtype a stage computes in, and why: bf16 on CUDA and on CPUs that run it natively (AVX512-bf16, AMX, Arm
bf16), fp32 on other CPUs, where bf16 matmuls are emulated and run tens to hundreds of times slower than fp32.

The decision (`choose_dtype`) is pure; `cpu_capability` reads the machine (DFLASH_CPU_CAPABILITY overrides it);
`resolve_dtype` logs the choice with its reason, and warns with bf16's measured cost on a CPU without native bf16.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = ["CAPABILITY_ENV", "NATIVE_BF16", "CAPABILITIES", "Capability", "DtypeChoice", "capability_from",
           "cpu_capability", "choose_dtype", "bf16_cost", "resolve_dtype", "compute_context"]

log = logging.getLogger(__name__)

CAPABILITY_ENV = "DFLASH_CPU_CAPABILITY"
# Capabilities under which bf16 matmuls run natively (oneDNN's AMX and AVX512-bf16 kernels, Arm's BFMMLA).
NATIVE_BF16 = ("AMX_BF16", "AVX512_BF16", "ARM_BF16")
# What DFLASH_CPU_CAPABILITY may name: the native ones and torch's own capability names.
CAPABILITIES = NATIVE_BF16 + ("AVX512", "AVX2", "DEFAULT", "SVE256", "ZVECTOR", "VSX")

# oneDNN's ISA levels in the order ONEDNN_MAX_CPU_ISA caps them (dnnl_cpu_isa_t); older aliases share a level.
_ONEDNN_ORDER = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                 "AVX512_CORE_BF16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                 "AVX10_2_512_AMX_2")
_ONEDNN_ALIASES = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX512_CORE_AMX": "AVX10_1_512_AMX",
                   "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16"}
# The oneDNN level each x86 native-bf16 capability needs, best first, with the CPU flag that proves it.
_X86_BF16 = (("AMX_BF16", "amx_bf16", "AVX10_1_512_AMX"), ("AVX512_BF16", "avx512_bf16", "AVX512_CORE_BF16"))


@dataclass(frozen=True)
class Capability:
    """A CPU's capability as the kernels will use it (e.g. AVX2, AMX_BF16), and where that came from."""

    name: str
    note: str = ""  # e.g. "from DFLASH_CPU_CAPABILITY", or the ONEDNN_MAX_CPU_ISA that holds bf16 back

    @property
    def native_bf16(self) -> bool:
        """Return True if bf16 matmuls run natively under this capability."""
        return self.name in NATIVE_BF16

    def __str__(self) -> str:
        return f"{self.name}, {self.note}" if self.note else self.name


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved compute dtype, the sentence that says why, and whether it is bf16 emulated on this CPU."""

    dtype: str
    reason: str
    slow_bf16: bool = False

    @property
    def line(self) -> str:
        """Return the log line: "dtype float32: this CPU has no native bf16 (AVX2)"."""
        return f"dtype {self.dtype}: {self.reason}"


def _onednn_level(isa: str | None) -> int | None:
    """Return the rank of a ONEDNN_MAX_CPU_ISA value in oneDNN's order (None: no cap, or one oneDNN ignores)."""
    if not isa:
        return None
    name = _ONEDNN_ALIASES.get(isa.strip().upper(), isa.strip().upper())
    return _ONEDNN_ORDER.index(name) if name in _ONEDNN_ORDER else None


def capability_from(torch_capability: str, cpu_flags: set[str] | frozenset[str], onednn_max_isa: str | None,
                    machine: str) -> Capability:
    """Return the capability of a CPU from torch's name for it, the CPU's flags, ONEDNN_MAX_CPU_ISA and the machine.

    torch names AVX512 even on a CPU with AMX, so native bf16 is read from the flags; a ONEDNN_MAX_CPU_ISA below a
    bf16 ISA takes it away, because bf16 matmuls run in oneDNN (measured here: AMX CPU, ONEDNN_MAX_CPU_ISA=AVX2,
    1.4 GFLOP/s bf16 against 198 fp32; ATEN_CPU_CAPABILITY=avx2 alone left bf16 at 336 against 129).
    """
    machine = machine.lower()
    if machine in ("aarch64", "arm64"):
        return Capability("ARM_BF16") if "bf16" in cpu_flags else Capability(torch_capability)
    cap = _onednn_level(onednn_max_isa)
    held: list[str] = []
    for name, flag, needs in _X86_BF16:
        if flag not in cpu_flags:
            continue
        if cap is None or cap >= _ONEDNN_ORDER.index(needs):
            return Capability(name)
        held.append(name)
    if held:
        return Capability(torch_capability, f"ONEDNN_MAX_CPU_ISA={onednn_max_isa} holds oneDNN below the CPU's "
                                            f"{held[0]}")
    return Capability(torch_capability)


def _cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """Return the CPU's feature flags ("flags" on x86, "Features" on aarch64); empty where there is no cpuinfo."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_capability(environ: Mapping[str, str] | None = None) -> Capability:
    """Return this CPU's capability: DFLASH_CPU_CAPABILITY when set, else torch's (which honours
    ATEN_CPU_CAPABILITY) refined by the CPU flags and ONEDNN_MAX_CPU_ISA; ConfigError for an unknown forced name."""
    env = os.environ if environ is None else environ
    forced = env.get(CAPABILITY_ENV, "").strip().upper()
    if forced:
        if forced not in CAPABILITIES:
            raise ConfigError(f"{CAPABILITY_ENV}={env[CAPABILITY_ENV]!r} is not a CPU capability dflash knows; use "
                              f"one of {', '.join(CAPABILITIES)}, or unset it to detect this CPU's")
        return Capability(forced, f"from {CAPABILITY_ENV}")
    import torch

    return capability_from(torch.backends.cpu.get_cpu_capability(), _cpu_flags(), env.get("ONEDNN_MAX_CPU_ISA"),
                           platform.machine())


def choose_dtype(requested: str, device: str, capability: Capability | None = None, *, auto: str | None = None,
                 prefer: str | None = None, auto_reason: str = "") -> DtypeChoice:
    """Return the dtype a stage computes in on `device` ("cpu", "cuda", "cuda:1") for a requested auto, bfloat16
    or float32, with the reason; capability is the CPU's (unused on CUDA).

    auto: what auto means for this caller instead of the hardware rule (the dtype of the run or store being
    resumed; generate's float32 on a CPU); prefer: what auto means unless it is bf16 that this CPU would emulate
    (eval: the run's own dtype); auto_reason says why either applies.
    """
    from ..config import DTYPES

    if requested != "auto" and requested not in DTYPES:
        raise ConfigError(f"--dtype {requested!r}: use auto, {', '.join(DTYPES)}")
    on_cpu = str(device).split(":")[0] == "cpu"
    assert capability is not None or not on_cpu, "a CPU device needs its capability"
    emulated = on_cpu and not capability.native_bf16
    if requested != "auto":
        reason = f"asked for with --dtype {requested}"
        if emulated and requested == "bfloat16":
            reason += f", though this CPU has no native bf16 ({capability})"
        return DtypeChoice(requested, reason, emulated and requested == "bfloat16")
    if prefer is not None and not (emulated and prefer == "bfloat16"):
        auto = prefer
    if auto is not None:
        return DtypeChoice(auto, auto_reason or f"auto is {auto} here", emulated and auto == "bfloat16")
    if not on_cpu:
        return DtypeChoice("bfloat16", "CUDA runs bf16 natively")
    if capability.native_bf16:
        return DtypeChoice("bfloat16", f"this CPU has native bf16 ({capability})")
    return DtypeChoice("float32", f"this CPU has no native bf16 ({capability})")


def _gflops(dtype: Any, n: int, min_seconds: float) -> float:
    """Return the GFLOP/s of an n x n matmul in dtype: its fastest of at least two runs and min_seconds."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # the kernels' one-time set-up, untimed
    # The fastest run, not the mean: on a shared machine a descheduled thread stalls the others at the barrier
    # (measured on 2 busy cores: fp32 256 matmuls took 0.22 ms or 8 ms by turns).
    best, runs, t0 = float("inf"), 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - t0 < min_seconds:
        t = time.perf_counter()
        a @ b
        best, runs = min(best, time.perf_counter() - t), runs + 1
    return 2 * n**3 / best / 1e9


@functools.lru_cache(maxsize=None)
def bf16_cost(n: int = 256) -> tuple[float, float]:
    """Return (bf16, fp32) GFLOP/s of n x n matmuls on this CPU, measured once per process.

    256 keeps it short even where bf16 is emulated: at 0.7 GFLOP/s one bf16 matmul takes 48 ms, and 3 run.
    """
    import torch

    return _gflops(torch.bfloat16, n, 0.05), _gflops(torch.float32, n, 0.02)


def resolve_dtype(requested: str, device: str, *, auto: str | None = None, prefer: str | None = None,
                  auto_reason: str = "", logger: logging.Logger | None = None) -> str:
    """Return the dtype to compute in (choose_dtype on this machine); log the choice and its reason, and warn with
    the measured cost when it is bf16 on a CPU without native bf16."""
    on_cpu = str(device).split(":")[0] == "cpu"
    choice = choose_dtype(requested, device, cpu_capability() if on_cpu else None, auto=auto, prefer=prefer,
                          auto_reason=auto_reason)
    say = logger or log
    say.info("%s", choice.line)
    if choice.slow_bf16:
        bf16, fp32 = bf16_cost()
        hint = ("--dtype auto would pick float32" if requested == "bfloat16"
                else "a new one with --dtype auto would pick float32 here")
        ratio = fp32 / max(bf16, 1e-9)
        # A forced capability (DFLASH_CPU_CAPABILITY) can claim emulation on a CPU where bf16 is in fact fast.
        slower = f"{ratio:.0f}x slower" if ratio >= 1.5 else "no slower here"
        say.warning("bf16 matmuls run at %.1f GFLOP/s on this CPU against %.0f in fp32 (%s); %s", bf16, fp32, slower,
                    hint)
    return choice.dtype


def compute_context(device_type: str, dtype: str) -> Any:
    """Return the autocast context of a compute dtype over fp32 weights (none for float32)."""
    import torch

    if dtype == "bfloat16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
