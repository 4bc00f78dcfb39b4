"""What jamp reads of JAX's traced programs, for every supported JAX release, in one place.

`jamp.autocast` re-evaluates jaxprs, so it reads the parameters of JAX's higher-order primitives,
each equation's trace-time context and the types of abstract values. These are JAX internals that
move between releases; no other jamp module reads them. Every function here either returns what
was asked for or raises `UnsupportedProgramError`, one line naming the primitive and the JAX
version, so that a program jamp cannot read fails at trace time instead of being mis-lowered.

Differences between the supported releases (JAX 0.10 to 0.12), and how each is read:

* `scan` records how many of its operands are loop-invariant constants and how many are the carry
  as `num_consts` / `num_carry` up to JAX 0.10, and as one flat tree `ft_in` of
  (consts, carry, xs) from 0.11 on (`scan_split`).
* `shard_map`'s equation records `mesh`, `in_specs`, `out_specs`, `check_vma` and the axes it
  makes manual (`manual_axes` in JAX 0.10.0, `newly_manual_axes` in 0.10.2 and later), from which
  `shard_map_like` builds the same mapping around a rewritten body.
* Evaluating a traced program again, equation by equation, outside `jit` is no longer bit-identical
  to running the Python that traced it from JAX 0.12 on (eager mode runs some library functions as
  fused computations): `jamp.autocast` therefore runs a function as written when its rewrite would
  change nothing (the float32 policy on a float32 model).

* Whether a value is under `vmap` (`is_batched`: JAX's private batching tracer class; jamp.fp8
  scales such matmuls statelessly), and the axis of the `vmap` a call runs in (`vmap_axis`: the
  batching trace's `axis_data`), for `jamp.autocast` to rewrite the batched program.
* A convolution's transposes are JAX's own rules (`conv_transposes`); reached through `jax.vjp`
  they widen 16-bit operands to an fp32 cotangent's dtype, so jamp calls them directly (the
  same private signature from 0.10 to 0.12) to keep 16-bit operands with an fp32 result.

* JAX's CUDA plugin (for `jamp.compile_for`) checks the CUDA libraries when JAX starts its
  backends; without an NVIDIA driver that check fails, with a traceback on every start, and the
  plugin cannot describe a GPU topology (`allow_deviceless_cuda`). Whether cuDNN can be loaded
  (what `jax.nn.dot_product_attention(implementation="cudnn")` asks first) is read from the
  plugin's private version module, the same from 0.10 to 0.12 (`cudnn_version`).
* From JAX 0.12.1 on, a multi-process CPU program read back from the persistent compilation
  cache waits forever in its first collective (0.12.0.1 and earlier run it; a compile that
  writes the cache runs too): `cached_cpu_collectives_hang`, for `python -m jamp.train` to keep
  such a run off the cache.
* JAX's settings are attributes of `jax.config` in every release (`jax_enable_compilation_cache`),
  but only from 0.12 on does its `Config` tell a type checker so (0.10's declares none of them,
  and `jax.config.read` refuses a setting that has a context manager, as these do):
  `config_value` reads one by name.
* `jax.sharding.SingleDeviceSharding` is deprecated from JAX 0.12.1 on: jamp builds one-device
  shardings with `jax.sharding.make_single_device_sharding` (public from 0.10 on) and asks
  whether a sharding is one with `is_single_device_sharding` (JAX's own from 0.12.1, the class
  before).

Stable across the range, read through the public `jax.extend.core`: `Jaxpr`, `ClosedJaxpr`,
`Literal`, `DropVar`, `jaxprs_in_params`; `while` (`cond_nconsts`, `body_nconsts`), `cond`
(`branches`), `remat2` (`jaxpr`, `prevent_cse`, `policy`), `custom_jvp_call` (`call_jaxpr`) and
`jit` (`jaxpr`) params; `eqn.ctx.manager`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

JAX_VERSION: str = jax.__version__


class UnsupportedProgramError(NotImplementedError):
    """A traced program that jamp cannot rewrite faithfully (raised at trace time)."""


def unsupported(primitive: str, what: str) -> UnsupportedProgramError:
    """The one-line error for an equation jamp cannot read."""
    return UnsupportedProgramError(
        f"jamp cannot rewrite a '{primitive}' equation under JAX {JAX_VERSION}: {what}. "
        "Supported: JAX 0.10 to 0.12; exclude the module with a float32 override or report it."
    )


def param(eqn: jcore.JaxprEqn, name: str) -> Any:
    """`eqn.params[name]`, or an `UnsupportedProgramError` naming what is missing."""
    try:
        return eqn.params[name]
    except KeyError:
        have = ", ".join(sorted(eqn.params)) or "none"
        raise unsupported(
            eqn.primitive.name, f"it has no parameter '{name}' (it has: {have})"
        ) from None


def scan_split(eqn: jcore.JaxprEqn) -> tuple[int, int]:
    """(number of constants, number of carried values) among a scan's operands."""
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:  # JAX 0.10
        return int(params["num_consts"]), int(params["num_carry"])
    if "ft_in" in params:  # JAX 0.11 and later: a flat tree (consts, carry, xs)
        try:
            consts, carry, _ = params["ft_in"].unpack()
            return len(list(consts.vals)), len(list(carry.vals))
        except (AttributeError, TypeError, ValueError):
            pass
    raise unsupported(
        "scan", "its parameters give neither num_consts/num_carry nor a (consts, carry, xs) ft_in"
    )


def while_split(eqn: jcore.JaxprEqn) -> tuple[int, int]:
    """(constants of the condition, constants of the body) among a while loop's operands."""
    return int(param(eqn, "cond_nconsts")), int(param(eqn, "body_nconsts"))


def bind_context(eqn: jcore.JaxprEqn):
    """The per-equation settings recorded at trace time, to re-enter when binding it again."""
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


# Primitives whose sub-programs are kernels (their bodies read and write buffers, run by a
# compiler of their own), not ordinary programs: they run as written, never rewritten inside.
KERNEL_PRIMITIVES = frozenset({"pallas_call"})


def is_batched(x: Any) -> bool:
    """Whether `x` is being traced by `jax.vmap` (a batching tracer: JAX's private
    `batching.BatchTracer`, the same class from 0.10 to 0.12)."""
    from jax._src.interpreters import batching

    return isinstance(x, batching.BatchTracer)


def vmap_axis(leaves) -> Any:
    """The axis of the `jax.vmap` that operations bind to right now (JAX's private
    `batching.AxisData`: `name`, `size`, `spmd_name`), where some of `leaves` is mapped along
    it; None otherwise (no vmap innermost, none of `leaves` mapped by it, or a vmap over an
    explicit mesh axis). The same classes and fields from 0.10 to 0.12."""
    from jax._src.interpreters import batching

    trace = current_trace()
    axis = getattr(trace, "axis_data", None)
    if not isinstance(trace, batching.BatchTrace) or axis is None:
        return None
    if getattr(axis, "explicit_mesh_axis", None) is not None:
        return None
    mapped = any(
        isinstance(x, batching.BatchTracer)
        and x._trace is trace
        and x.batch_dim is not None  # (None: not mapped, in every release)
        for x in leaves
    )
    return axis if mapped else None


def current_trace() -> Any:
    """The trace that operations bind to right now (a value's identity, to tell whether a call
    runs in the same program as another or inside a transform of it: scan, remat, vmap, cond).
    None where this JAX has no trace context (then every call counts as the same)."""
    from jax._src import core

    ctx = getattr(core, "trace_ctx", None)
    return getattr(ctx, "trace", None)


def _is_ref(aval) -> bool:
    # Mutable buffers (Pallas refs, `jax.new_ref`, run_state) have an abstract type of their own.
    return type(aval).__name__ == "AbstractRef"


def is_kernel(eqn: jcore.JaxprEqn) -> bool:
    """Whether `eqn` is a kernel call: a known kernel primitive, or any equation whose
    sub-programs take or return mutable buffers."""
    if eqn.primitive.name in KERNEL_PRIMITIVES:
        return True
    for sub in jcore.jaxprs_in_params(eqn.params):
        if any(_is_ref(v.aval) for v in list(sub.invars) + list(sub.constvars)):
            return True
    return False


def shard_map_like(eqn: jcore.JaxprEqn, body):
    """`body` (flat operands -> tuple of outputs) under the same `shard_map` as `eqn`."""
    return jax.shard_map(
        body,
        mesh=param(eqn, "mesh"),
        in_specs=tuple(param(eqn, "in_specs")),
        out_specs=tuple(param(eqn, "out_specs")),
        check_vma=bool(param(eqn, "check_vma")),
        axis_names=set(param(eqn, _first_present(eqn, "newly_manual_axes", "manual_axes"))),
    )


def _first_present(eqn: jcore.JaxprEqn, *names: str) -> str:
    # The first of `names` that the equation has (the last one if none, for `param`'s error).
    return next((n for n in names if n in eqn.params), names[-1])


def conv_transposes(g, lhs, rhs, params, lhs_dtype, rhs_dtype):
    """The gradients of `conv_general_dilated(lhs, rhs, **params)` for the cotangent `g`.

    Each is one convolution on the operands as given (16-bit, say) whose result comes back in
    `lhs_dtype` / `rhs_dtype` (its `preferred_element_type`, float32 say), by JAX's own
    transpose rules, which know the windows, dilations and groups.
    """
    from jax._src.interpreters import ad
    from jax._src.lax import convolution

    kwargs = {k: v for k, v in dict(params).items() if k != "preferred_element_type"}
    kwargs.setdefault("out_sharding", None)
    d_lhs = convolution._conv_general_dilated_transpose_lhs(
        g,
        ad.UndefinedPrimal(lhs.aval.update(dtype=np.dtype(lhs_dtype))),
        rhs,
        preferred_element_type=np.dtype(lhs_dtype),
        **kwargs,
    )
    d_rhs = convolution._conv_general_dilated_transpose_rhs(
        g,
        lhs,
        ad.UndefinedPrimal(rhs.aval.update(dtype=np.dtype(rhs_dtype))),
        preferred_element_type=np.dtype(rhs_dtype),
        **kwargs,
    )
    return d_lhs, d_rhs


def allow_deviceless_cuda() -> None:
    """Without an NVIDIA driver, lets JAX's CUDA plugin start for deviceless compiles.

    The plugin checks its CUDA libraries' versions when JAX starts its backends. On a machine
    with no NVIDIA driver that check can only fail: it prints a traceback on every start, and
    the plugin then cannot describe a GPU topology for `jamp.compile_for`. Where no driver is
    present (neither /proc/driver/nvidia nor /dev/nvidiactl) this sets
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 unless it is set already; with a driver nothing changes.
    It must run before JAX starts its backends (`import jamp` runs it).
    """
    if os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl"):
        return
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def cudnn_version() -> int | None:
    """The version of the cuDNN that JAX's CUDA plugin loads (e.g. 92800), or None: no plugin,
    or no cuDNN it can find. Loading the library needs no GPU or driver."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except (RuntimeError, OSError):
        return None


def config_value(name: str) -> Any:
    """The current value of JAX's setting `name` (e.g. "jax_compilation_cache_dir")."""
    return getattr(jax.config, name)


def is_single_device_sharding(sharding: Any) -> bool:
    """Whether `sharding` puts an array on one device. JAX 0.12.1 deprecates the class
    `jax.sharding.SingleDeviceSharding` for `jax.sharding.is_single_device_sharding` (and
    `make_single_device_sharding`, public from 0.10 on, to build one); before 0.12.1 the class is
    the only way to ask."""
    check = getattr(jax.sharding, "is_single_device_sharding", None)
    if check is not None:
        return bool(check(sharding))
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "0.12.0.1" -> (0, 12, 0, 1), "0.13.0.dev1" ->
    (0, 13, 0)."""
    numbers = []
    for part in version.split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


def cached_cpu_collectives_hang(version: str = JAX_VERSION) -> bool:
    """Whether this JAX hangs in the collectives of a multi-process CPU program that it reads
    from the persistent compilation cache. Seen with JAX 0.12.1 (two processes, a `pmap` psum
    over their devices, the second run of it: every process waits in the all-reduce); 0.12.0.1
    and earlier run it. Assumed of every later release until one is seen to run it."""
    return _release(version) >= (0, 12, 1)
