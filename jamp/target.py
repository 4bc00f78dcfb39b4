"""NVIDIA GPUs as compile targets on any machine: a step's real GPU program without the GPU.

JAX compiles for a GPU that is not there: the CUDA plugin (`pip install -e '.[gpu-compile]'`,
no driver needed) describes a topology of GPUs from a target config, and a step lowered for
those devices with abstract arguments compiles to the program XLA would run on them, with its
buffer assignment. `compile_for` does that for any jitted step and reads the result
(`jamp.inspect.compiled.CompileReport`): memory per device by dtype, GEMMs by kernel and dtype,
attention (fused or not), collectives by mesh axis.

Targets by name: a GPU (`h100`: H100 SXM 80 GB, `h200`: H200 141 GB, `b200`), `xN` for N of them
in a host (`h200x8`), and `Mx` in front for M such hosts (`2x h200x8`). Each target config is
written here from the GPU's published figures (NVIDIA's datasheets; the memory size is what
the driver reports).

Example::

  target = get_target("h200x8")
  mesh = target.mesh("fsdp=8")
  step = jamp.sharding.make_sharded_train_step(train_step, mesh, shardings)
  report = compile_for(step, abstract_state, abstract_batch, key, target=target)
  print(report.table())

The memory is XLA's plan for the target (what is live, in which dtype), not a measured peak.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import time
import warnings
from typing import Any, Optional, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jamp import hardware, jax_compat
from jamp.hlo import dump
from jamp.inspect.compiled import memory_fraction  # re-exported: what "fits" is measured against

# What installs the plugin and cuDNN: the gpu-compile extra (jamp-jax is not released yet).
INSTALL_HINT = "in a checkout of jamp, pip install -e '.[gpu-compile]'"


class TargetUnavailable(RuntimeError):
    """The GPU compiler cannot be reached here (no CUDA plugin); the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU model's published figures, and the target config XLA compiles for from them."""

    name: str  # jamp's name: "h200"
    kind: str  # the device kind JAX reports: "NVIDIA H200"
    compute_capability: tuple[int, int]
    sm_count: int
    hbm_bytes: int  # as the driver reports it (a bit less than the datasheet's GB)
    memory_bandwidth: float  # bytes/s
    l2_bytes: int
    clock_ghz: float  # boost clock
    bf16_tflops: float  # dense tensor-core peak
    fp8_tflops: float  # dense tensor-core peak

    def target_config(self) -> str:
        """The `gpu_device_info` text proto that `get_topology_desc` takes."""
        major, minor = self.compute_capability
        fields = {
            "threads_per_block_limit": 1024,
            "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": 228 * 1024,  # Hopper and Blackwell SMs: 228 KiB
            "shared_memory_per_block_optin": 227 * 1024,
            "threads_per_core_limit": 2048,
            "core_count": self.sm_count,
            "fpus_per_core": 128,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": int(self.memory_bandwidth),
            "l2_cache_size": self.l2_bytes,
            "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": self.hbm_bytes,
            "registers_per_core_limit": 65536,
            "registers_per_block_limit": 65536,
        }
        lines = [f"  {k}: {v}" for k, v in fields.items()]
        lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
        return (
            "gpu_device_info {\n" + "\n".join(lines) + "\n}\n"
            'platform_name: "CUDA"\n'
            "dnn_version_info { major: 9 minor: 10 }\n"
            "runtime_version { major: 12 minor: 9 }\n"
            f'device_description_str: "{self.kind}"\n'
        )


#: The GPUs jamp knows, from NVIDIA's published figures (dense peaks, without sparsity).
GPUS = {
    # name, device kind, compute capability, SMs, memory as the driver reports it (bytes),
    # bandwidth (B/s), L2, boost clock (GHz), dense bf16 and fp8 TFLOP/s
    "h100": Gpu(
        "h100",
        "NVIDIA H100 80GB HBM3",
        (9, 0),
        132,
        84_942_979_072,
        3.35e12,
        50 << 20,
        1.98,
        989.4,
        1978.9,
    ),
    "h200": Gpu(
        "h200", "NVIDIA H200", (9, 0), 132, 150_754_820_096, 4.8e12, 50 << 20, 1.98, 989.4, 1978.9
    ),
    "b200": Gpu(
        "b200",
        "NVIDIA B200",
        (10, 0),
        148,
        191_514_411_008,
        8.0e12,
        126 << 20,
        1.965,
        2250.0,
        4500.0,
    ),
}
_NAME = re.compile(r"^\s*(?:(?P<hosts>\d+)\s*x\s*)?(?P<gpu>[a-z]\d+)(?:\s*x\s*(?P<per>\d+))?\s*$")


@dataclasses.dataclass(frozen=True)
class Target:
    """`hosts` hosts of `gpus_per_host` GPUs each."""

    gpu: Gpu
    gpus_per_host: int = 1
    hosts: int = 1

    @property
    def name(self) -> str:
        one = self.gpu.name + (f"x{self.gpus_per_host}" if self.gpus_per_host > 1 else "")
        return f"{self.hosts}x {one}" if self.hosts > 1 else one

    @property
    def num_devices(self) -> int:
        return self.gpus_per_host * self.hosts

    @property
    def devices(self) -> list:
        """The target's devices (topology devices: compile for them, never run on them)."""
        return list(_topology(self.gpu, self.hosts, self.gpus_per_host).devices)

    def mesh(self, spec: Union[str, dict] = "fsdp=-1") -> Mesh:
        """A mesh over the target's devices, as `jamp.sharding.make_mesh(spec)` builds one."""
        from jamp import sharding  # here: sharding sits above nothing of this module's

        return sharding.make_mesh(spec, self.devices)

    def __str__(self) -> str:
        return self.name


def target_names() -> list[str]:
    """The GPU names; each takes `xN` (GPUs per host) and `Mx ` (hosts) around it."""
    return list(GPUS)


def get_target(name: Union[str, Target]) -> Target:
    """The target a name describes: "h200", "h200x8", "2x h200x8" (also "2xh200x8").

    Raises:
      ValueError: one line listing the targets.
    """
    if isinstance(name, Target):
        return name
    m = _NAME.match(str(name).lower())
    if not m or m.group("gpu") not in GPUS:
        raise ValueError(
            f"unknown target {name!r}; targets: {', '.join(GPUS)}, each with xN for N GPUs in "
            "a host (h200x8) and Mx in front for M hosts (2x h200x8)"
        )
    per, hosts = int(m.group("per") or 1), int(m.group("hosts") or 1)
    if per < 1 or hosts < 1:
        raise ValueError(f"target {name!r}: GPUs per host and hosts must be at least 1")
    return Target(GPUS[m.group("gpu")], per, hosts)


def cudnn_available() -> bool:
    """Whether the CUDA plugin finds cuDNN here (installed by the gpu-compile extra). Without it
    a GPU program is compiled as for a GPU without cuDNN: attention written out, not fused."""
    return plugin_available() and jax_compat.cudnn_version() is not None


def plugin_available() -> bool:
    """Whether JAX's CUDA plugin is installed (what compiling for a GPU target needs)."""
    for name in ("xla_cuda12", "xla_cuda13"):
        try:
            if importlib.util.find_spec(f"jax_plugins.{name}") is not None:
                return True
        except ModuleNotFoundError:  # no jax_plugins package at all: no plugin of any kind
            return False
    return False


@functools.lru_cache(maxsize=None)
def _topology(gpu: Gpu, hosts: int, per_host: int):
    from jax.experimental import topologies

    if not plugin_available():
        raise TargetUnavailable(
            f"compiling for a GPU target needs JAX's CUDA plugin: {INSTALL_HINT} "
            "(jax-cuda12-plugin at jaxlib's version; no GPU or driver needed)"
        )
    if not cudnn_available():
        warnings.warn(
            f"cuDNN is not installed here: {gpu.name} programs compile without its fused "
            f"attention (written out instead), unlike on a GPU with cuDNN; {INSTALL_HINT} "
            "(nvidia-cudnn-cu12)",
            RuntimeWarning,
            stacklevel=4,
        )
    try:
        return topologies.get_topology_desc(
            platform="cuda",
            target_config=gpu.target_config(),
            topology=f"1x{hosts}x{per_host}",
        )
    except Exception as e:  # the plugin failed to start (e.g. its CUDA checks, without a driver)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetUnavailable(
            f"the CUDA plugin cannot describe a {gpu.name} topology ({first}); without a GPU "
            "driver set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before JAX starts (import jamp first "
            "does it)"
        ) from None


def _abstract(x, sharding):
    """An argument leaf as a ShapeDtypeStruct, with `sharding` if it has none of its own."""
    if isinstance(x, jax.ShapeDtypeStruct):
        given = x.sharding
    else:
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype  # no copy of arrays
        x = jax.ShapeDtypeStruct(np.shape(x), dtype)
        given = None
    if given is not None and not (
        isinstance(given, NamedSharding) or jax_compat.is_single_device_sharding(given)
    ):
        given = None
    own = given if given is not None and _on_target(given) else sharding
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=own)


def _on_target(sharding) -> bool:
    return all(d.platform != "cpu" for d in sharding.device_set)


def compile_for(
    fn,
    *args,
    target: Union[str, Target] = "h200",
    mesh: Optional[Mesh] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    **kwargs,
):
    """Compiles `fn(*args, **kwargs)` for `target` and reports what its program keeps and runs.

    Nothing is allocated: array arguments are taken as shapes and dtypes (pass
    `jax.ShapeDtypeStruct`s, e.g. from `jax.eval_shape`, so that a 7B-parameter state compiles on
    a small CPU machine). The program is traced for the target's devices
    (`jamp.hardware.compiling_for`): `activations="auto"` and jamp's matmul lowering decide as
    on the GPU, whatever machine compiles.

    Args:
      fn: a function, or a jitted one (e.g. from `jamp.sharding.make_sharded_train_step` on
        `target.mesh(...)`, which carries its shardings).
      *args, **kwargs: its arguments (arrays or ShapeDtypeStructs). Leaves without a sharding on
        the target are replicated over `mesh` when one is given, put on the target's first
        device when the target has one device, and otherwise left to `fn`'s own shardings.
      target: a name (`get_target`) or a `Target`.
      mesh: the mesh the step runs on (its axes name the collectives); default: the mesh of the
        arguments' shardings, if any.
      compiler_options: XLA options for this compile, e.g. {"xla_gpu_enable_triton_gemm":
        False} for cuBLAS GEMMs where XLA would pick Triton ones.

    Returns:
      A `jamp.inspect.compiled.CompileReport`.

    Raises:
      TargetUnavailable: no CUDA plugin here.
      ValueError: a bad target name, or a step that did not compile for the target's devices.
    """
    from jamp.inspect import _paths, compiled

    target = get_target(target)
    started = time.perf_counter()
    # The module calls made while tracing name each op's module by its params path.
    (lowered, tracing), calls = _paths.recording_calls(
        fn, lambda: _lower(fn, target, mesh, args, kwargs)
    )
    options = {"xla_dump_hlo_as_text": True, **(compiler_options or {})}
    executable, files = dump.compile_dumped(lowered, options, keep=compiled.DUMPS)
    seconds = time.perf_counter() - started
    used = _program_devices(executable)
    if used and not used <= set(target.devices):
        kinds = sorted({f"{d.platform} {d.device_kind}".strip() for d in used})
        raise ValueError(
            f"the step compiled for {', '.join(kinds)} devices, not for {target.name}'s: give its "
            "arguments shardings on the target (target.mesh(...)) or jit it with in_shardings there"
        )
    return compiled.build_report(
        target=target,
        devices=len(used) or target.num_devices,
        executable=executable,
        files=files,
        mesh=mesh or _mesh_of(executable),
        activations=sorted(tracing.activations),
        attention_traced=tracing.attention,
        compile_seconds=seconds,
        calls=calls,
    )


def _lower(fn, target: Target, mesh, args, kwargs):
    """`fn` lowered for `target` with abstract arguments, and the `compiling_for` record."""
    devices = target.devices
    default: Optional[jax.sharding.Sharding] = None
    if mesh is not None:
        default = NamedSharding(mesh, P())
    elif target.num_devices == 1:
        default = jax.sharding.make_single_device_sharding(devices[0])
    abstract_args, abstract_kwargs = jax.tree.map(lambda x: _abstract(x, default), (args, kwargs))
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    # jax.default_device is part of JAX's tracing cache key: a step traced before for the CPU
    # (its jaxpr cached) is traced again for the target, where jamp's forms differ.
    with jax.default_device(devices[0]), hardware.compiling_for(devices[0]) as tracing:
        return jitted.lower(*abstract_args, **abstract_kwargs), tracing


def _program_devices(executable) -> set:
    try:
        shardings = jax.tree.leaves(executable.input_shardings)
    except Exception:  # an executable without inputs
        return set()
    return {d for s in shardings for d in s.device_set}


def _mesh_of(executable) -> Optional[Mesh]:
    try:
        shardings = jax.tree.leaves(executable.input_shardings)
    except Exception:
        return None
    for s in shardings:
        if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
            return s.mesh
    return None


__all__ = [
    "GPUS",
    "Gpu",
    "Target",
    "TargetUnavailable",
    "compile_for",
    "get_target",
    "memory_fraction",
    "plugin_available",
    "target_names",
]
