"""Precision policies: jmp's string grammar, Keras-style presets and clear errors.

A policy names three dtypes: the one parameters are stored in, the one the
model computes in, and the one its outputs are returned in. `get_policy` returns one type for
every spec, `Policy` (`jamp.policy`): a `jmp.Policy`, so anything that takes a jmp policy takes
ours, with two fields more.

A fourth, optional dtype says what gradients cross the wire in when parameters are sharded
over devices (FSDP2's `reduce_dtype`): `"mixed_bfloat16,reduce=bf16"`. It defaults to float32.

A preset may name another params dtype: `"mixed_bfloat16,params=bf16"` stores the params in
bfloat16 (2 bytes each instead of 4); the train step applies their updates in float32 and rounds
them back stochastically (`jamp.rounding`), so updates smaller than half a bfloat16 ulp are kept in
expectation rather than lost.

A fifth says what matmuls run in when it is not the compute dtype: `matmul=f8` (the preset
`"mixed_fp8"`, i.e. "p=f32,c=bf16,o=f32,matmul=f8") runs every matmul on fp8 operands (E4M3
activations and weights, E5M2 gradients, float32 accumulation; `jamp.fp8`) and the rest as
mixed_bfloat16 does. Convolutions, the output head and normalization stay bfloat16 / float32.

`"auto"` names the policy that pays on this device: mixed_bfloat16 where it runs bfloat16 matmuls
natively, float32 where it does not (`jamp.hardware.auto_policy`; `auto_reason` says which).
"""

import dataclasses
import difflib
from typing import Union

import jax.numpy as jnp
import jmp

from jamp import hardware
from jamp.policy import Policy

PRESETS = ("float32", "mixed_float16", "mixed_bfloat16", "mixed_fp8")

# Presets are spelt in jmp's grammar so that jmp builds every policy we return.
_PRESET_SPECS = {
    "float32": "p=f32,c=f32,o=f32",
    "mixed_float16": "p=f32,c=f16,o=f32",
    "mixed_bfloat16": "p=f32,c=bf16,o=f32",
    "mixed_fp8": "p=f32,c=bf16,o=f32,m=f8",
}
# Resolved when a policy is made, from what the default device runs natively.
AUTO = "auto"
_KEYS = {
    "p": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
    "r": "reduce",
    "reduce": "reduce",
    "m": "matmul",
    "matmul": "matmul",
}
#: What `matmul=` accepts: fp8 (E4M3 forward, E5M2 gradients).
MATMUL_NAMES = ("f8", "fp8", "float8")
# jmp also knows float64; mixed precision has no use for it, so it is refused.
# "half" is jmp's backend-dependent 16-bit type (bfloat16 on TPU, float16 elsewhere).
DTYPE_NAMES = ("float32", "f32", "full", "float16", "f16", "half", "bfloat16", "bf16")
_ALLOWED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_ACCEPTED = (
    "Accepted: a preset (" + ", ".join(PRESETS) + "), 'auto', a dtype name for all three dtypes "
    "(f32, bf16, f16, ...) or key=dtype pairs such as 'p=f32,c=bf16,o=f32' (keys p/params, "
    "c/compute, o/output, r/reduce, m/matmul; the grammar: jamp.get_policy, "
    "docs/guides/policies.md)."
)
# What users type for the presets (PyTorch's and the prose's names): suggested, not taken, since
# jmp's grammar gives a bare dtype name ("bf16") its own meaning, all three dtypes.
_MEANT = {
    "fp16": "mixed_float16",
    "amp": "mixed_float16",
    "mixed_fp16": "mixed_float16",
    "mixed_f16": "mixed_float16",
    "fp8": "mixed_fp8",
    "f8": "mixed_fp8",
    "float8": "mixed_fp8",
    "mixed_bf16": "mixed_bfloat16",
    "fp32": "float32",
}
_F32 = jnp.dtype(jnp.float32)


def is_fp8(policy: "PolicyLike") -> bool:
    """Whether `policy`'s matmuls run in fp8."""
    return get_policy(policy).is_fp8


def without_fp8(policy: "PolicyLike") -> jmp.Policy:
    """`policy` with its matmuls back in its compute dtype (mixed_fp8 -> mixed_bfloat16).

    A `Policy`, typed as jmp's so that mypy sees the three dtype fields `dataclasses.replace` sets.
    """
    return dataclasses.replace(get_policy(policy), matmul="")


def autocast_dtype(policy: "PolicyLike"):
    """The dtype `jamp.autocast` runs `policy`'s matmuls in: its compute dtype, or for an fp8
    policy the marker `jamp.policy.MATMUL_MARKER` (fp8 matmuls, bfloat16 between them)."""
    return get_policy(policy).autocast_dtype


def reduce_dtype(policy: "PolicyLike") -> jnp.dtype:
    """The dtype `policy`'s sharded gradients cross devices in: float32 unless it names another."""
    return jnp.dtype(get_policy(policy).reduce_dtype)


PolicyLike = Union[str, jmp.Policy]


def _fail(spec, problem: str) -> ValueError:
    meant = _MEANT.get(spec.strip().lower()) if isinstance(spec, str) else None
    if meant is None and isinstance(spec, str):
        close = difflib.get_close_matches(spec.strip(), [*PRESETS, AUTO], n=1, cutoff=0.75)
        meant = close[0] if close else None
    hint = f" Did you mean {meant!r}?" if meant else ""
    return ValueError(f"Bad precision policy {spec!r}: {problem}.{hint} {_ACCEPTED}")


def _check_dtype(name: str, spec) -> None:
    if name not in DTYPE_NAMES:
        raise _fail(spec, f"Unknown dtype {name!r}")


def _normalise(spec: str) -> tuple[str, str, str]:
    """Checks `spec` against the grammar; returns it in jmp's spelling, the reduce dtype name and
    the matmul format ("" or "f8")."""
    text = spec.strip()
    if not text:
        raise _fail(spec, "empty string")
    head, _, rest = text.partition(",")
    if head.strip() == AUTO:  # the device's choice; a reduce dtype may follow, as for a preset
        head = _auto_preset()
    if head.strip() in _PRESET_SPECS:  # a preset, perhaps with a reduce dtype after it
        preset = _PRESET_SPECS[head.strip()]
        if any(_KEYS.get(part.partition("=")[0].strip()) == "params" for part in rest.split(",")):
            # a params dtype after a preset replaces the preset's (16-bit stored params)
            preset = preset.partition(",")[2]
        text = preset + ("," + rest if rest else "")
    if "=" not in text:
        _check_dtype(text, spec)
        return text, "f32", ""
    parts, seen, reduce, matmul = [], set(), "f32", ""
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep:
            raise _fail(spec, f"entry {part!r} is not of the form key=dtype")
        if key not in _KEYS:
            raise _fail(spec, f"unknown key {key!r}")
        if _KEYS[key] in seen:
            # jmp lets the last one win silently; a typo should not pass unnoticed.
            raise _fail(spec, f"duplicate key {key!r} ({_KEYS[key]} given twice)")
        seen.add(_KEYS[key])
        if _KEYS[key] == "matmul":
            if value not in MATMUL_NAMES:
                raise _fail(spec, f"matmul={value!r}: matmul takes {', '.join(MATMUL_NAMES)}")
            matmul = "f8"
            continue
        _check_dtype(value, spec)
        if _KEYS[key] == "reduce":
            reduce = value
        else:
            parts.append(f"{key}={value}")
    if not parts:
        raise _fail(spec, "a reduce or matmul entry alone names no policy")
    return ",".join(parts), reduce, matmul


def _auto_preset() -> str:
    policy, _ = hardware.auto_policy()
    return "mixed_bfloat16" if jnp.dtype(policy.compute_dtype) == jnp.bfloat16 else "float32"


def auto_reason(spec: PolicyLike) -> Union[str, None]:
    """The line saying which policy `"auto"` picked and why, when `spec` names "auto"; else None.

    Example:
        >>> auto_reason("mixed_bfloat16") is None
        True
        >>> auto_reason("auto,reduce=bf16")  # doctest: +SKIP
        'auto picked mixed_bfloat16: AMD EPYC (avx512_bf16) runs bfloat16 matmuls natively.'
    """
    if not isinstance(spec, str) or spec.partition(",")[0].strip() != AUTO:
        return None
    return hardware.auto_policy()[1]


def get_policy(spec: PolicyLike) -> Policy:
    """Returns the `jamp.precision.Policy` (a `jmp.Policy`) named by `spec`.

    Args:
        spec: a `jmp.Policy` (a jamp `Policy` is returned as is, jmp's own as a `Policy` with the
            same three dtypes, not validated); a preset from `PRESETS`; "auto" (the
            preset this device runs fastest: see `auto_reason`); a dtype name for all three
            dtypes ("bf16"); or jmp's "p=...,c=...,o=..." grammar, where an omitted output
            follows compute ("c=f16" computes and returns float16). A preset or "auto" may
            add ",reduce=<dtype>" and ",params=bf16" (bfloat16 stored params).

    Returns:
        The policy, its three dtypes parsed by `jmp.get_policy`.

    Raises:
        ValueError: naming the bad part of `spec` and listing what is accepted.

    Example:
        >>> describe(get_policy("mixed_bfloat16"))
        'params=float32,compute=bfloat16,output=float32'
    """
    if isinstance(spec, jmp.Policy):
        return Policy.of(spec)
    if not isinstance(spec, str):
        raise _fail(spec, f"expected a string or jmp.Policy, got {type(spec).__name__}")
    normalised, reduce, matmul = _normalise(spec)
    try:
        policy = jmp.get_policy(normalised)
        reduce = jnp.dtype(jmp.get_policy(reduce).param_dtype)
    except Exception as e:  # Our grammar check should leave nothing for jmp to refuse.
        raise _fail(spec, str(e)) from e
    for dtype in (policy.param_dtype, policy.compute_dtype, policy.output_dtype, reduce):
        if jnp.dtype(dtype) not in _ALLOWED:
            raise _fail(spec, f"dtype {jnp.dtype(dtype).name!r} is not a mixed-precision dtype")
    if matmul and jnp.dtype(policy.compute_dtype) != jnp.bfloat16:
        # fp8 GEMMs beside fp16 elementwise math overflow in the gaps between them
        # (Transformer Engine #2415); bf16 has float32's range.
        raise _fail(spec, "matmul=f8 needs compute=bf16")
    return Policy(policy.param_dtype, policy.compute_dtype, policy.output_dtype, reduce, matmul)


def describe(policy: PolicyLike) -> str:
    """Returns a policy as "params=...,compute=...,output=..." with full dtype names.

    Args:
        policy: a `jmp.Policy` or anything `get_policy` accepts.

    Returns:
        A short string for logs and summary tables.

    Example:
        >>> describe("c=bf16")
        'params=float32,compute=bfloat16,output=bfloat16'
    """
    p = get_policy(policy)
    names = (jnp.dtype(d).name for d in (p.param_dtype, p.compute_dtype, p.output_dtype))
    text = "params={},compute={},output={}".format(*names)
    reduce = jnp.dtype(p.reduce_dtype)
    if reduce != _F32:
        text += f",reduce={reduce.name}"
    return text + (",matmul=fp8" if p.is_fp8 else "")
