"""Whether a device runs a dtype's matmuls natively, and what follows for the precision policy.

A 16-bit policy pays only where the hardware multiplies 16-bit operands natively; elsewhere the
operands are converted to float32 for every matmul and the policy costs time instead of saving
it. This module answers the question per device, so that the training program can warn, the
policy name ``"auto"`` can choose, and `jamp.mixed_ops` can pick its matmul lowering:

* CPU: the 16-bit instruction sets in ``/proc/cpuinfo`` (x86 ``avx512_bf16``, ``amx_bf16``,
  ``avx512_fp16``, ``amx_fp16``; Arm ``bf16``, ``asimdhp``). Without ``/proc/cpuinfo`` (macOS,
  Windows) the answer is unknown, and says so.
* NVIDIA GPU: the compute capability: float16 tensor cores from 7.0, bfloat16 from 8.0, fp8 from
  8.9. AMD Instinct GPUs: by model.
* TPU: bfloat16 is the matrix unit's own type.

`matmul_lowering` turns the answer into the form `jamp.mixed_ops` gives a mixed matmul: "native"
(16-bit operands into the dot) or, on CPUs without native 16-bit matmuls, "upcast" (the 16-bit
operands widened to float32 for a float32 dot: the same products, on float32's fast kernels).

Example::

  >>> s = support("bfloat16")
  >>> s.native, s.device  # doctest: +SKIP
  (True, 'AMD EPYC (avx512_bf16)')
  >>> policy, why = auto_policy()  # mixed_bfloat16 where bf16 is native, float32 elsewhere

Nothing here imports the rest of jamp (it sits below `jamp.precision` and `jamp.mixed_ops`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from typing import Any, FrozenSet, Iterator, Optional

import jax
import numpy as np

from jamp.policy import Policy

# The device a program is traced for: jamp.traced_for, re-exported here, where it is asked.
from jamp.traced_for import (  # noqa: F401
    Tracing,
    compiling_for,
    target_device,
    target_platform,
    tracing,
)

BF16 = np.dtype(jax.numpy.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

# The /proc/cpuinfo flags that give a CPU native 16-bit matmuls, per dtype (x86 first, then Arm).
CPU_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),
    "float16": ("avx512_fp16", "amx_fp16", "asimdhp"),
}
_SHOWN_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16", "bf16", "asimdhp")
_CPUINFO = "/proc/cpuinfo"


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    """A CPU's model name and flags; `flags` is None when they could not be read."""

    name: str
    flags: Optional[FrozenSet[str]]


@dataclasses.dataclass(frozen=True)
class Support:
    """Whether `device` runs `dtype`'s matmuls natively.

    Attributes:
      dtype: the dtype asked about.
      native: True / False, or None when jamp cannot tell.
      platform: "cpu", "gpu", "tpu", ...
      device: the device in words, e.g. "AMD EPYC (avx512_bf16)" or
        "NVIDIA H200, compute capability 9.0".
      detail: one sentence on what it means for speed.
    """

    dtype: np.dtype
    native: Optional[bool]
    platform: str
    device: str
    detail: str

    def __str__(self) -> str:
        verdict = {True: "native", False: "emulated", None: "unknown"}[self.native]
        return f"{self.dtype.name} on {self.device}: {verdict}. {self.detail}"


def parse_cpuinfo(text: str) -> CpuInfo:
    """Reads the model name and flags of the first processor in a /proc/cpuinfo text.

    x86 kernels list them under "flags", Arm kernels under "Features".

    Example:
        >>> parse_cpuinfo("model name : AMD EPYC\\nflags : fpu avx512_bf16\\n").flags
        frozenset({'avx512_bf16', 'fpu'})
    """
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    flags = fields.get("flags", fields.get("features"))
    name = fields.get("model name") or fields.get("cpu model") or fields.get("hardware") or "CPU"
    return CpuInfo(name, None if flags is None else frozenset(flags.split()))


@functools.lru_cache(maxsize=1)
def read_cpuinfo() -> CpuInfo:
    """This machine's CPU, read from /proc/cpuinfo once per process (flags None without it)."""
    try:
        with open(_CPUINFO) as f:
            return parse_cpuinfo(f.read())
    except OSError:
        import platform

        return CpuInfo(platform.processor() or platform.machine() or "CPU", None)


def _cpu_name(cpu: CpuInfo) -> str:
    if cpu.flags is None:
        return f"{cpu.name} (no {_CPUINFO}: 16-bit instruction sets unknown)"
    shown = [f for f in _SHOWN_FLAGS if f in cpu.flags]
    return f"{cpu.name} ({', '.join(shown) or 'no 16-bit matmul instructions'})"


def _cpu_support(dtype: np.dtype, cpu: CpuInfo) -> tuple[Optional[bool], str]:
    if dtype == F32:
        return True, "float32 is every CPU's baseline."
    if dtype.name not in CPU_FLAGS:  # fp8
        return False, f"no CPU multiplies {dtype.name} natively: it is converted to float32."
    if cpu.flags is None:
        return (
            None,
            f"whether {dtype.name} matmuls are native is unknown; float32 is the safe choice.",
        )
    have = [f for f in CPU_FLAGS[dtype.name] if f in cpu.flags]
    if dtype == BF16 and have:
        return True, (
            f"bfloat16 x bfloat16 -> float32 matmuls run on {'/'.join(have)}, "
            "so a bfloat16 policy's matmuls are faster than float32's."
        )
    if have:  # float16: the instructions exist, but XLA:CPU has no float16 matmul kernels
        return False, (
            f"the CPU has float16 instructions ({'/'.join(have)}), but XLA:CPU converts float16 "
            "matmuls to float32 (it has no float16 kernels), so a float16 policy is no faster "
            "than float32 here."
        )
    wanted = "/".join(CPU_FLAGS[dtype.name][:2])
    return False, (
        f"no {wanted}: {dtype.name} matmuls are converted to float32, so a {dtype.name} policy "
        "is no faster than float32 here and can be slower."
    )


def _capability(device) -> Optional[tuple[int, int]]:
    cc = getattr(device, "compute_capability", None)
    if isinstance(cc, (tuple, list)) and len(cc) >= 2:
        return int(cc[0]), int(cc[1])
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(cc)) if cc is not None else None
    return (int(m.group(1)), int(m.group(2))) if m else None


# Minimum NVIDIA compute capability for native matmuls: float16 tensor cores came with Volta,
# bfloat16 with Ampere, fp8 with Ada / Hopper.
_NVIDIA_MIN = {"float16": (7, 0), "bfloat16": (8, 0), "float8": (8, 9)}


def _gpu_support(dtype: np.dtype, device) -> tuple[Optional[bool], str, str]:
    kind = getattr(device, "device_kind", "GPU")
    key = "float8" if dtype.name.startswith("float8") else dtype.name
    if "AMD" in kind or "Instinct" in kind:
        # Matrix cores take bf16/f16 from MI100 (CDNA) on, fp8 from MI300 (CDNA 3).
        gen = re.search(r"MI\s*(\d)", kind)
        if dtype == F32:
            return True, kind, "float32 is every GPU's baseline."
        if gen is None:
            return None, kind, f"jamp does not know this AMD GPU's {dtype.name} matmul support."
        native = int(gen.group(1)) >= (3 if key == "float8" else 1)
        return native, kind, f"{dtype.name} matmuls {'run on' if native else 'lack'} matrix cores."
    cc = _capability(device)
    name = f"{kind}, compute capability {cc[0]}.{cc[1]}" if cc else kind
    if dtype == F32:
        tf32 = cc is not None and cc >= (8, 0)
        return (
            True,
            name,
            (
                "float32 matmuls run as TF32 at JAX's default precision."
                if tf32
                else "float32 is every GPU's baseline."
            ),
        )
    if cc is None or key not in _NVIDIA_MIN:
        return None, name, f"jamp cannot tell whether this GPU runs {dtype.name} natively."
    need = _NVIDIA_MIN[key]
    if cc >= need:
        return True, name, f"{dtype.name} matmuls run on tensor cores, faster than float32."
    return (
        False,
        name,
        (
            f"{dtype.name} needs compute capability {need[0]}.{need[1]}+ for tensor cores: "
            "it is emulated, no faster than float32."
        ),
    )


def _tpu_support(dtype: np.dtype) -> tuple[Optional[bool], str]:
    if dtype in (F32, BF16):
        return True, "bfloat16 is the TPU matrix unit's own type (float32 runs as bf16 passes)."
    if dtype == F16:
        return False, "TPUs have no float16 matmuls: float16 is converted; use bfloat16."
    return None, f"{dtype.name} support depends on the TPU generation."


def support(dtype, device=None, *, cpu: Optional[CpuInfo] = None) -> Support:
    """Whether `device` runs matmuls on `dtype` operands natively.

    Args:
      dtype: float32, bfloat16, float16 or an fp8 dtype (anything `np.dtype` accepts).
      device: a `jax.Device` (or anything with `platform`, `device_kind` and, for NVIDIA GPUs,
        `compute_capability`); default: `target_device()`, the device the program being traced
        is compiled for (the first device of JAX's default backend outside `compiling_for`).
      cpu: for CPU devices, the `CpuInfo` to judge instead of this machine's /proc/cpuinfo
        (tests fake CPUs with `parse_cpuinfo`).

    Returns:
      A `Support`; `native` is None where jamp cannot tell.

    Example:
        >>> zen3 = parse_cpuinfo("model name : AMD EPYC 7B13\\nflags : avx2 fma\\n")
        >>> support("bfloat16", cpu=zen3).native
        False
    """
    dtype = np.dtype(dtype)
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating) or dtype.itemsize > 4:
        raise ValueError(f"support() judges float32, 16-bit and fp8 dtypes, not {dtype.name}")
    device = target_device() if device is None else device
    platform = str(getattr(device, "platform", "unknown")).lower()
    if platform == "cpu":
        cpu = read_cpuinfo() if cpu is None else cpu
        native, detail = _cpu_support(dtype, cpu)
        return Support(dtype, native, platform, _cpu_name(cpu), detail)
    if platform in ("gpu", "cuda", "rocm"):
        native, name, detail = _gpu_support(dtype, device)
        return Support(dtype, native, "gpu", name, detail)
    kind = str(getattr(device, "device_kind", platform))
    if platform == "tpu":
        native, detail = _tpu_support(dtype)
        return Support(dtype, native, platform, kind, detail)
    detail = f"jamp does not know whether {platform} devices run {dtype.name} natively."
    return Support(dtype, dtype == F32 or None, platform, kind, detail)


def _preset(policy: Any) -> str:
    """A short name for a policy in messages: its preset name where it is one."""
    dtypes = tuple(
        np.dtype(getattr(policy, f)) for f in ("param_dtype", "compute_dtype", "output_dtype")
    )
    presets: dict[tuple[np.dtype, ...], str] = {
        (F32, BF16, F32): "mixed_bfloat16",
        (F32, F16, F32): "mixed_float16",
    }
    presets.update({(F32, F32, F32): "float32", (BF16,) * 3: "bfloat16", (F16,) * 3: "float16"})
    return presets.get(dtypes, f"the policy computing in {dtypes[1].name}")


def auto_policy(device=None, *, cpu: Optional[CpuInfo] = None) -> tuple[Policy, str]:
    """The policy ``"auto"`` stands for on `device`, and one line saying why.

    mixed_bfloat16 where bfloat16 matmuls are native, float32 where they are not or where jamp
    cannot tell (float32 never loses speed to missing 16-bit hardware).

    Example:
        >>> policy, why = auto_policy(cpu=parse_cpuinfo("model name : X\\nflags : avx2\\n"))
        >>> why  # doctest: +ELLIPSIS
        'auto picked float32: X (no 16-bit matmul instructions) ...'
    """
    s = support(BF16, device, cpu=cpu)
    if s.native:
        policy = Policy(F32, BF16, F32)
        return policy, f"auto picked mixed_bfloat16: {s.device} runs bfloat16 matmuls natively."
    policy = Policy(F32, F32, F32)
    if s.native is None:
        why = f"auto picked float32: {s.device}; {s.detail}"
    else:
        why = f"auto picked float32: {s.device} has no native bfloat16 matmuls, so bfloat16 is emulated."
    f16 = support(F16, device, cpu=cpu)
    if f16.native and s.platform == "gpu":  # e.g. a V100: float16 tensor cores, no bfloat16
        why += " mixed_float16 (with loss scaling) would run natively here."
    return policy, why


def emulation_warning(policy, device=None, *, cpu: Optional[CpuInfo] = None) -> Optional[str]:
    """One line when `policy`'s compute dtype is emulated on `device`, naming the faster choice.

    Args:
      policy: a `jmp.Policy` (`jamp.get_policy` turns names into one).
      device, cpu: as for `support`.

    Returns:
      The warning, or None when the compute dtype is float32, is native, or jamp cannot tell.

    Example:
        >>> zen3 = parse_cpuinfo("model name : AMD EPYC 7B13\\nflags : avx2\\n")
        >>> emulation_warning(Policy(F32, BF16, F32), cpu=zen3)  # doctest: +ELLIPSIS
        'warning: mixed_bfloat16 computes in bfloat16, which AMD EPYC 7B13 ... float32 is ...'
    """
    dtype = np.dtype(policy.compute_dtype)
    if Policy.of(policy).is_fp8:
        s = support(np.dtype("float8_e4m3fn"), device, cpu=cpu)
        if s.native is not False:
            return None
        faster = "mixed_bfloat16" if support(BF16, device, cpu=cpu).native else "float32"
        return (
            f"warning: mixed_fp8 multiplies in fp8, which {s.device} does not run natively: its "
            f"fp8 matmuls are emulated in float32 and slower than bfloat16's; {faster} is the "
            "faster choice here."
        )
    if dtype == F32:
        return None
    s = support(dtype, device, cpu=cpu)
    if s.native is not False:
        return None
    other = F16 if dtype == BF16 else BF16
    faster = "float32"
    if dtype.itemsize == 2 and support(other, device, cpu=cpu).native:
        faster = "mixed_bfloat16" if other == BF16 else "mixed_float16 (with loss scaling)"
    how = "its matmuls are emulated in float32 and no faster"
    if s.platform == "cpu" and "XLA:CPU" in s.detail:  # the CPU has the instructions
        how = (
            f"XLA:CPU has no {dtype.name} matmul kernels (whatever the CPU's {dtype.name} "
            "instructions), so its matmuls run in float32 and no faster"
        )
    return (
        f"warning: {_preset(policy)} computes in {dtype.name}, which {s.device} does not run "
        f"natively: {how}; {faster} is the faster choice here."
    )


# ----- the matmul lowering jamp.mixed_ops picks from this

LOWERINGS = ("auto", "native", "upcast")
LOWERING_ENV = "JAMP_MATMUL_LOWERING"
_pinned: list[Optional[str]] = [None]


def _check_lowering(name: str) -> str:
    if name not in LOWERINGS:
        raise ValueError(f"matmul lowering {name!r} is not one of {', '.join(LOWERINGS)}")
    return name


@contextlib.contextmanager
def pinned_lowering(name: str) -> Iterator[None]:
    """Within the block, functions traced use lowering `name` whatever the hardware.

    Example::

      with pinned_lowering("upcast"):
          jaxpr = jax.make_jaxpr(f)(x)  # float32 dots on operands rounded to 16 bits
    """
    previous, _pinned[0] = _pinned[0], _check_lowering(name)
    try:
        yield
    finally:
        _pinned[0] = previous


def matmul_lowering(compute_dtype, device=None, *, cpu=None) -> str:
    """How mixed matmuls in `compute_dtype` are lowered: "native" or "upcast".

    A pin (`pinned_lowering`, else ``$JAMP_MATMUL_LOWERING``) wins; otherwise CPUs without
    native matmuls for `compute_dtype` (`support`, unknown included) get "upcast": jamp widens
    the 16-bit operands itself and runs a float32 dot, which uses the kernels float32 uses,
    instead of leaving a 16-bit dot to be converted or emulated. That this is the faster form
    on such a CPU is inferred from the compiled programs, not yet timed on one
    (experiments/results/lowering_cpu.md). Every other device gets "native" (GPU compilers
    emulate what their hardware lacks).
    `device` and `cpu` are as for `support`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> zen3 = parse_cpuinfo("model name : EPYC 7B13\\nflags : avx2\\n")
        >>> with pinned_lowering("auto"):
        ...     matmul_lowering(jnp.bfloat16, jax.devices("cpu")[0], cpu=zen3)
        'upcast'
    """
    name = _pinned[0] or os.environ.get(LOWERING_ENV, "auto").strip() or "auto"
    if name not in LOWERINGS:
        raise ValueError(f"{LOWERING_ENV}={name!r} is not one of {', '.join(LOWERINGS)}")
    if name != "auto":
        return name
    s = support(compute_dtype, device, cpu=cpu)
    return "upcast" if s.platform == "cpu" and not s.native else "native"
