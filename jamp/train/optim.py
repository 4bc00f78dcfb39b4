"""Optax optimizers and learning-rate schedules built from a small dataclass.

Example::

  tx, schedule = make_optimizer(OptimConfig(optimizer="adamw", learning_rate=3e-4,
                                            schedule="warmup_cosine", warmup_steps=100,
                                            num_train_steps=10_000))
"""

from __future__ import annotations

import dataclasses
import math

import optax

from jamp import lowbit

OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")
SCHEDULES = ("constant", "cosine", "warmup_cosine")
#: What the optimizer's state is stored in (`jamp.lowbit`).
STATES = ("float32", "bfloat16", "int8")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """What `make_optimizer` builds.

    Attributes:
      optimizer: one of `OPTIMIZERS`.
      learning_rate: the peak learning rate.
      schedule: one of `SCHEDULES`; the cosine ones decay to 0 at `num_train_steps`.
      warmup_steps: linear warmup from 0 (``warmup_cosine`` only).
      num_train_steps: the length of the run, for the decay.
      weight_decay: decoupled weight decay (``adamw``) or L2 added to the gradient (others).
      momentum: for ``momentum`` (heavy ball, Nesterov).
      state: one of `STATES`: the optimizer's state in float32, in bfloat16 (stochastically
        rounded: `jamp.lowbit.bf16_state`) or in 8 bits (`jamp.lowbit.int8_state`).
      seed: the bfloat16 state's rounding stream.
      kahan_dtype: "" or the 16-bit dtype the params are stored in, to update them with Kahan
        compensation (`jamp.lowbit.kahan`) instead of stochastic rounding.
    """

    optimizer: str = "adam"
    learning_rate: float = 1e-3
    schedule: str = "constant"
    warmup_steps: int = 0
    num_train_steps: int = 1000
    weight_decay: float = 0.0
    momentum: float = 0.9
    state: str = "float32"
    seed: int = 0
    kahan_dtype: str = ""

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; accepted: {', '.join(SCHEDULES)}"
            )
        if not 0 < self.learning_rate < math.inf:
            raise ValueError(f"learning_rate must be finite and > 0, got {self.learning_rate}")
        if self.warmup_steps < 0 or self.warmup_steps > self.num_train_steps:
            raise ValueError(
                f"warmup_steps must be between 0 and num_train_steps ({self.num_train_steps}), "
                f"got {self.warmup_steps}"
            )
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"weight_decay must be finite and >= 0, got {self.weight_decay}")
        if self.state not in STATES:
            raise ValueError(
                f"unknown optimizer_state {self.state!r}; accepted: {', '.join(STATES)}"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """The learning rate as a function of the optimizer step."""
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.learning_rate)
    if cfg.schedule == "cosine":
        return optax.cosine_decay_schedule(cfg.learning_rate, max(cfg.num_train_steps, 1))
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.num_train_steps, cfg.warmup_steps + 1)
    )


def make_optimizer(cfg: OptimConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns the optax transformation and its learning-rate schedule (for logging)."""
    schedule = make_schedule(cfg)
    tx = _optimizer(cfg, schedule)
    if cfg.state == "bfloat16":
        tx = lowbit.bf16_state(tx, seed=cfg.seed)
    elif cfg.state == "int8":
        tx = lowbit.int8_state(tx)
    if cfg.kahan_dtype:
        tx = lowbit.kahan(tx, cfg.kahan_dtype)
    return tx, schedule


def _optimizer(cfg: OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    if cfg.optimizer == "adamw":
        return optax.adamw(schedule, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        tx = optax.adam(schedule)
    elif cfg.optimizer == "sgd":
        tx = optax.sgd(schedule)
    else:
        tx = optax.sgd(schedule, momentum=cfg.momentum, nesterov=True)
    if cfg.weight_decay:
        tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay), tx)
    return tx
