"""The training program's config, validated and split into the dataclasses each part owns.

`parse_config` turns the ml_collections ConfigDict into a `RunConfig` (the loop's settings), a
`jamp.train.data.DataConfig` and a `jamp.train.optim.OptimConfig`, raising `ConfigError` with one line for
anything the program cannot run with; `resolve_workdir` checks the workdir without creating it.
Nothing past this module sees a ConfigDict.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import ml_collections
import numpy as np

from jamp import activations as activations_lib
from jamp import adaptive, fp8, hardware, precision, rounding, sharding
from jamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jamp.models import model_task
from jamp.precision import get_policy
from jamp.train import data as data_lib
from jamp.train.optim import OptimConfig
from jamp.train.overflow_watch import ON_PERSISTENT_OVERFLOW

LOSS_SCALES = ("auto", "dynamic", "static", "none")
PARALLELISM = ("pmap", "sharded")
#: How 16-bit params take their float32 update (--config.param_rounding).
PARAM_ROUNDINGS = (*rounding.MODES, "kahan")


class ConfigError(ValueError):
    """A config value the program cannot run with; its message is one line for the user."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The loop's own settings, taken from the config."""

    model: str
    model_config: dict
    batch_size: int
    policy: jmp.Policy
    activations: str
    loss_scale: Any
    num_train_steps: int
    accumulation_steps: int
    max_grad_norm: float | None
    log_every_steps: int
    eval_every_steps: int
    checkpoint_every_steps: int
    max_checkpoints_to_keep: int
    seed: int
    on_persistent_overflow: str
    persistent_overflow_steps: int
    parallelism: str = "pmap"
    mesh: Any = None  # a jax.sharding.Mesh when parallelism == "sharded"
    trace_nonfinite: bool = False
    profile_steps: int = 0
    # (recipe, history, margin) of an fp8 policy's scaling (`jamp.fp8`); None: no fp8 matmuls.
    fp8: Any = None
    # (k, n, demote_after or None) of adaptive precision (`jamp.adaptive`); None: off.
    adaptive: Any = None
    # module path patterns and first:N / last:N forms computing in float32 (`keep_in_float32`).
    keep_in_float32: tuple = ()
    # how 16-bit params take their float32 update: stochastic | nearest (`jamp.make_train_step`'s
    # param_rounding; the config's "auto" resolved) | kahan (`jamp.lowbit.kahan` around the
    # optimizer)
    param_rounding: str = "stochastic"

    @property
    def step_rounding(self) -> str:
        """The train step's own param_rounding (Kahan's updates land on representable values)."""
        return "nearest" if self.param_rounding == "kahan" else self.param_rounding


def _make_loss_scale(kind: str, p: ml_collections.ConfigDict, policy: jmp.Policy):
    if kind not in LOSS_SCALES:
        raise ConfigError(f"unknown loss_scale {kind!r}; accepted: {', '.join(LOSS_SCALES)}")
    if kind == "auto":
        kind = "dynamic" if np.dtype(policy.compute_dtype) == np.float16 else "none"
    if kind == "none":
        return NoOpLossScale()
    # The fields whose names differ from the library's arguments are checked here, so that the
    # message names the config field; the library checks the others.
    initial, low, high = float(p.initial), float(p.min_scale), float(p.max_scale)
    if not 0 < initial < math.inf:
        raise ConfigError(f"loss_scale_params.initial must be finite and > 0, got {initial}")
    if kind == "static":
        return StaticLossScale(initial)
    if not 0 < low <= high < math.inf:
        raise ConfigError(
            "loss_scale_params need 0 < min_scale <= max_scale < inf, "
            f"got min_scale {low} and max_scale {high}"
        )
    if not low <= initial <= high:
        raise ConfigError(
            f"loss_scale_params.initial must be between min_scale {low} and max_scale {high}, "
            f"got {initial}"
        )
    try:
        return DynamicLossScale(
            initial,
            growth_interval=int(p.growth_interval),
            growth_factor=float(p.growth_factor),
            backoff_factor=float(p.backoff_factor),
            hysteresis=int(p.hysteresis),
            min_loss_scale=low,
            max_loss_scale=high,
        )
    except ValueError as e:  # "DynamicLossScale: growth_factor must be > 1, got 1.0"
        raise ConfigError(f"loss_scale_params: {e}") from None


def _positive(config, *names):
    for name in names:
        value = config[name]
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def parse_config(config: ml_collections.ConfigDict, devices=None):
    """Validates `config` and splits it into (RunConfig, DataConfig, OptimConfig).

    `devices` are those the run is for: `jax.devices()` when None; a GPU target's devices when
    the step is only compiled for them (`--compile_for`).

    Raises:
      ConfigError: with a one-line message naming the bad field and what is accepted.
    """
    _positive(config, "batch_size", "num_train_steps", "accumulation_steps", "log_every_steps")
    _positive(config, "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep")
    _positive(config, "persistent_overflow_steps")
    if config.on_persistent_overflow not in ON_PERSISTENT_OVERFLOW:
        raise ConfigError(
            f"unknown on_persistent_overflow {config.on_persistent_overflow!r}; accepted: "
            f"{', '.join(ON_PERSISTENT_OVERFLOW)}"
        )
    try:
        policy = get_policy(config.policy)
        param_rounding = _param_rounding(config, policy)
        hardware.matmul_lowering(policy.compute_dtype)  # a bad $JAMP_MATMUL_LOWERING, now
        activations_lib.resolve(config.activations)
        loss_scale = _make_loss_scale(config.loss_scale, config.loss_scale_params, policy)
        task = model_task(config.model)
        optim = _optim_config(config, policy, param_rounding)
        data = _data_config(config)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    if not config.max_grad_norm >= 0:  # also NaN
        raise ConfigError(
            f"max_grad_norm must be >= 0 (0: no clipping), got {config.max_grad_norm}"
        )
    _check_accumulation(config, devices)
    mesh = _mesh(config, devices)
    run = RunConfig(
        model=config.model,
        model_config=config.model_config.to_dict(),
        batch_size=config.batch_size,
        policy=policy,
        activations=config.activations,
        loss_scale=loss_scale,
        num_train_steps=config.num_train_steps,
        accumulation_steps=config.accumulation_steps,
        max_grad_norm=float(config.max_grad_norm) or None,
        log_every_steps=config.log_every_steps,
        eval_every_steps=config.eval_every_steps,
        checkpoint_every_steps=config.checkpoint_every_steps,
        max_checkpoints_to_keep=config.max_checkpoints_to_keep,
        seed=int(config.seed),
        on_persistent_overflow=config.on_persistent_overflow,
        persistent_overflow_steps=config.persistent_overflow_steps,
        parallelism=config.parallelism,
        mesh=mesh,
        trace_nonfinite=_trace_nonfinite(config),
        profile_steps=_profile_steps(config),
        fp8=_fp8(config, policy),
        adaptive=_adaptive(config, policy),
        keep_in_float32=_keep_in_float32(config),
        param_rounding=param_rounding,
    )
    return run, data, optim, task


def _optim_config(config, policy, param_rounding: str) -> OptimConfig:
    """The optimizer's fields of `config` (a Kahan-summed run keeps its compensation in the
    params' dtype)."""
    return OptimConfig(
        optimizer=config.optimizer,
        learning_rate=float(config.learning_rate),
        schedule=config.schedule,
        warmup_steps=int(config.warmup_steps),
        num_train_steps=int(config.num_train_steps),
        weight_decay=float(config.weight_decay),
        momentum=float(config.momentum),
        state=config.get("optimizer_state", "float32"),
        seed=int(config.seed),
        kahan_dtype=np.dtype(policy.param_dtype).name if param_rounding == "kahan" else "",
    )


def _data_config(config) -> data_lib.DataConfig:
    """The input pipeline's fields of `config`."""
    return data_lib.DataConfig(
        dataset=config.dataset,
        batch_size=int(config.batch_size),
        data_dir=config.data_dir or None,
        seq_len=int(config.seq_len),
        seed=int(config.seed),
        download=bool(config.download),
        **_synthetic_fields(config),
    )


def _check_accumulation(config, devices) -> None:
    """Refuses accumulation steps that do not divide the per-device batch: checked here rather
    than when the step is traced, after the workdir has been written."""
    count = jax.device_count() if devices is None else len(devices)
    per_device, remainder = divmod(config.batch_size, count)
    if not remainder and per_device % config.accumulation_steps:
        raise ConfigError(
            f"accumulation_steps {config.accumulation_steps} does not divide the per-device batch "
            f"of {per_device} (batch_size {config.batch_size} over {count} devices): use a "
            f"batch_size that is a multiple of {count * config.accumulation_steps}"
        )


def _param_rounding(config, policy) -> str:
    """The params' rounding mode ("auto" resolved: stochastic), checked against the policy's
    params dtype (float16 params are refused)."""
    mode = config.get("param_rounding", "auto")
    if mode not in PARAM_ROUNDINGS:
        raise ConfigError(
            f"unknown param_rounding {mode!r}; accepted: {', '.join(PARAM_ROUNDINGS)}"
        )
    dtype = np.dtype(policy.param_dtype)
    if dtype == np.float16:
        # float16's range, not its precision, fails weights: the program trains none in it.
        raise ConfigError(
            f"policy {config.policy!r} stores params in float16, which the program refuses "
            "(a bare dtype name sets all three dtypes, as in jmp): did you mean "
            "'mixed_float16' (float32 params, float16 compute)?"
        )
    if mode == "auto":
        return "stochastic"
    if mode == "kahan" and dtype != np.dtype(jnp.bfloat16):
        raise ConfigError(
            f"param_rounding=kahan compensates the rounding of bfloat16 params, but policy "
            f"{config.policy!r} stores them in {dtype.name}: add ',params=bf16' to the policy"
        )
    return mode


def _adaptive(config, policy):
    """(k, n, demote_after) when adaptive precision is on, else None; or a one-line ConfigError."""
    on = config.get("adaptive_precision", False)
    if not isinstance(on, bool):
        raise ConfigError(f"adaptive_precision must be true or false, got {on!r}")
    params = config.get("adaptive", None) or {}
    k = params.get("k", adaptive.DEFAULT_K)
    n = params.get("n", adaptive.DEFAULT_N)
    demote = params.get("demote_after", 0)
    for name, value in (("k", k), ("n", n), ("demote_after", demote)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"adaptive.{name} must be a non-negative integer, got {value!r}")
    if not 1 <= k <= n:
        raise ConfigError(f"adaptive needs 1 <= k <= n, got k={k} and n={n}")
    if not on:
        return None
    if config.get("profile_steps", 0):
        raise ConfigError(
            "adaptive_precision reads every step's metrics, and profiled steps log none: use "
            "profile_steps in a run without adaptive_precision"
        )
    if demote and demote <= k:
        raise ConfigError(
            f"adaptive.demote_after must be 0 (off) or greater than adaptive.k, got "
            f"demote_after={demote} and k={k}: decisions come every k steps, so a promoted module "
            "would go back down at the first decision after its promotion"
        )
    stop = config.get("persistent_overflow_steps", None)
    stops = config.get("on_persistent_overflow", "stop") == "stop"
    if stops and isinstance(stop, int) and stop < k:
        raise ConfigError(
            f"persistent_overflow_steps={stop} is less than adaptive.k={k}: the run would stop "
            f"after {stop} skipped steps in a row at the loss scale's floor, while adaptive "
            f"precision decides every {k} steps, so it could stop before a promotion; raise "
            "persistent_overflow_steps, lower adaptive.k, or set on_persistent_overflow=warn"
        )
    return (k, n, demote or None)


def _keep_in_float32(config) -> tuple[str, ...]:
    value = config.get("keep_in_float32", "")
    if isinstance(value, str):
        items = [p.strip() for p in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        items = [p.strip() for p in value]
    else:
        raise ConfigError(
            f"keep_in_float32 takes module path patterns and first:N / last:N, comma-separated, "
            f"got {value!r}"
        )
    return tuple(p for p in items if p)


def _fp8(config, policy):
    recipe = config.get("fp8_recipe", "delayed")
    history = config.get("fp8_history", 16)
    margin = config.get("fp8_margin", 0.0)
    try:
        fp8.check_recipe(recipe, history, margin)
    except ValueError as e:  # checked for every policy: a typo should not wait for an fp8 run
        raise ConfigError(f"fp8_{e}") from None
    return (recipe, history, float(margin)) if precision.is_fp8(policy) else None


def _trace_nonfinite(config) -> bool:
    value = config.get("trace_nonfinite", False)
    if not isinstance(value, bool):
        raise ConfigError(f"trace_nonfinite must be true or false, got {value!r}")
    if value and jax.process_count() > 1:
        # The re-run reads the whole batch on one process; the others hold only their slices.
        raise ConfigError(
            f"trace_nonfinite runs on one process only; this run has {jax.process_count()}"
        )
    return value


def _profile_steps(config) -> int:
    value = config.get("profile_steps", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"profile_steps must be an integer >= 0 (0: off), got {value!r}")
    if value and value + 1 > config.num_train_steps:
        raise ConfigError(
            f"profile_steps {value} plus one warm-up step do not fit in num_train_steps "
            f"{config.num_train_steps}"
        )
    return value


def _mesh(config, devices=None):
    """The device mesh of a sharded run (None under pmap), or a one-line ConfigError."""
    if config.parallelism not in PARALLELISM:
        raise ConfigError(
            f"unknown parallelism {config.parallelism!r}; accepted: {', '.join(PARALLELISM)}"
        )
    if config.parallelism == "pmap":
        return None
    try:
        mesh = sharding.make_mesh(config.mesh, devices)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None
    return mesh


def _synthetic_fields(config) -> dict:
    # Only the synthetic recipes carry these fields.
    fields = {}
    for name in ("image_shape", "num_classes", "vocab_size"):
        if name in config:
            value = config[name]
            fields[name] = tuple(value) if isinstance(value, (list, tuple)) else value
    return fields


def resolve_workdir(workdir: str | pathlib.Path | None) -> pathlib.Path:
    """The workdir to use (a fresh one under ./runs/ when None), checked without creating it."""
    if not workdir and jax.process_count() > 1:  # each process would pick its own time stamp
        raise ConfigError("a multi-process run needs --workdir, the same one for every process")
    if not workdir:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        workdir = pathlib.Path("runs") / stamp
        print(f"workdir: {workdir.resolve()}", flush=True)
    path = pathlib.Path(workdir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"workdir {path} is not writable: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"workdir {path} is not writable: no write permission on {existing}")
    return path


def prepare_workdir(path: pathlib.Path) -> pathlib.Path:
    """Creates the workdir and checks that a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".jamp_write_probe.{jax.process_index()}"  # processes share the workdir
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"workdir {path} is not writable: {e.strerror or e}") from None
    return path
