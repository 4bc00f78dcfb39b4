"""The device a program is being traced for, when it is not JAX's default backend's.

A GPU target compiled on a CPU host (`jamp.compile_for`), or a mesh of another platform's
devices, is traced on the host; every per-platform choice jamp makes while tracing
(`jamp.hardware.support` and `matmul_lowering`, `jamp.activations`' "auto", `jamp.mixed_ops`'
CPU-only forms) asks `target_device()` / `target_platform()` here, so the program is the one
that device would be given. `jamp.hardware` re-exports all of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Optional

import jax

# Set while a program is traced for devices other than JAX's default backend (a GPU target
# compiled on a CPU host, a mesh of another platform): every per-platform choice jamp makes while
# tracing (`support`, `matmul_lowering`, `jamp.activations`' "auto", `jamp.mixed_ops`' CPU
# forms) asks `target_device()`, so the program is the one that device would be given.
_TARGET: contextvars.ContextVar = contextvars.ContextVar("jamp_target", default=None)


@dataclasses.dataclass
class Tracing:
    """The device a program is being traced for, and what jamp chose for it meanwhile.

    Attributes:
      device: the `jax.Device` (or topology device) the program is compiled for.
      activations: the activation forms ("compute", "float32") that wrapped models resolved to
        while tracing under this record.
      attention: per attention the engine recognised, (module path, how it runs: "cudnn",
        "xla" or "unfused", why not cuDNN: "" where it is).
    """

    device: Any
    activations: set = dataclasses.field(default_factory=set)
    attention: list = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def compiling_for(device) -> Iterator[Tracing]:
    """Within the block, programs are traced for `device` instead of JAX's default backend.

    Example::

      with compiling_for(mesh.devices.flat[0]) as tracing:
          lowered = jax.jit(step).lower(*abstract_args)   # GPU forms on a CPU host
      tracing.activations                                # {"compute"}
    """
    outer = _TARGET.get()  # nested (a sharded step inside `jamp.compile_for`): note in both
    record = (
        Tracing(device) if outer is None else Tracing(device, outer.activations, outer.attention)
    )
    token = _TARGET.set(record)
    try:
        yield record
    finally:
        _TARGET.reset(token)


def tracing() -> Optional[Tracing]:
    """The `compiling_for` record in effect, or None."""
    return _TARGET.get()


def target_device():
    """The device programs traced now are compiled for (`compiling_for`'s, else JAX's first)."""
    record = _TARGET.get()
    return jax.devices()[0] if record is None else record.device


def target_platform() -> str:
    """ "cpu", "gpu", "tpu", ... of `target_device()` ("cuda" and "rocm" read "gpu")."""
    record = _TARGET.get()
    if record is None:
        platform = jax.default_backend()
    else:
        platform = str(getattr(record.device, "platform", "unknown")).lower()
    return "gpu" if platform in ("cuda", "rocm") else platform
