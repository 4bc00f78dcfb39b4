"""Overflow costs one skipped step and nothing else: fault injection, natural overflow, bad inputs,
the loss scale's bounds, and the training program's answer to an overflow that never ends.

The models are real and small (a two-block `jamp.models.ResNet`, a Dense + BatchNorm MLP),
wrapped with `jamp.wrap`, so a skipped step has batch statistics and Adam moments to leave alone.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from subproc import cli_env, forked_cli

import jamp
from jamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jamp.models import ResNet
from jamp.train.overflow_watch import OverflowWatch

KEY = jax.random.key(0)
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ models, data, state, checks


class BNMLP(nn.Module):
    """Dense -> BatchNorm -> relu -> Dense on flattened images."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, images, train=False):
        x = nn.Dense(64)(images.reshape(images.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(self.num_classes)(nn.relu(x))


def make_loss_fn(model):
    def loss_fn(params, model_state, batch, rng):
        del rng  # no dropout: runs that differ only in their step count compute the same
        logits, new_model_state = model.apply(
            {"params": params, **model_state}, batch["image"], train=True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        # The fault switch: poison 0 leaves the loss bit for bit (x * 1 is exact); inf, -inf or
        # nan make every gradient non-finite while the forward pass, batch statistics included,
        # stays finite, so a step that kept its new statistics would go unnoticed but for the
        # bit-identity checks.
        loss = loss * (1.0 + batch["poison"])
        accuracy = jnp.mean(logits.argmax(-1) == batch["label"])
        return loss, (new_model_state, {"accuracy": accuracy})

    return loss_fn


def init_state(model, tx, loss_scale, image_shape):
    # Jitted: run eagerly, a ResNet's init compiles every op on its own, for seconds.
    init = jax.jit(lambda key, x: model.init(key, x, train=False))
    variables = dict(init(KEY, jnp.zeros((1, *image_shape))))
    params = variables.pop("params")
    return jamp.TrainState.create(params, tx, model_state=variables, loss_scale=loss_scale)


def with_scale(state, value):
    """`state` with its loss scale's value replaced (a leaf: nothing recompiles)."""
    if isinstance(state.loss_scale, NoOpLossScale):
        return state
    return state.replace(loss_scale=state.loss_scale.replace(loss_scale=jnp.float32(value)))


def synthetic_images(num, shape, seed, num_classes=10):
    """Learnable float32 images: a per-class pattern plus as much noise."""
    rng = np.random.default_rng(seed)
    prototypes = rng.normal(size=(num_classes, *shape))
    labels = rng.integers(0, num_classes, num).astype(np.int32)
    images = prototypes[labels] + rng.normal(size=(num, *shape))
    return images.astype(np.float32), labels


def digits():
    """scikit-learn's 1797 8x8 handwritten digits in [0, 1], shuffled; (train, eval) splits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    images = (data.images[order] / 16.0).astype(np.float32)[..., None]
    labels = data.target[order].astype(np.int32)
    return (images[:1500], labels[:1500]), (images[1500:], labels[1500:])


def batches_of(images, labels, batch_size):
    return [
        {
            "image": images[i : i + batch_size],
            "label": labels[i : i + batch_size],
            "poison": np.float32(0.0),
        }
        for i in range(0, len(labels) - batch_size + 1, batch_size)
    ]


@jax.jit
def snapshot(state):
    """The leaves a skipped step must leave alone (params, optimizer and model state), as two flat
    vectors: the bit patterns of every float (all fp32 here) and every integer."""
    leaves = jax.tree.leaves((state.params, state.opt_state, state.model_state))
    floats = [x.ravel() for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    ints = [x.ravel() for x in leaves if not jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(x.dtype == jnp.float32 for x in floats) and all(x.dtype == jnp.int32 for x in ints)
    # Bit patterns, not values: -0.0 differs from 0.0, and one nan from another.
    return jax.lax.bitcast_convert_type(jnp.concatenate(floats), jnp.uint32), jnp.concatenate(ints)


def kept(state):
    return jax.device_get(snapshot(state))


def assert_bit_identical(new, old, where):
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a, b, err_msg=where)


def assert_all_finite(snap, where):
    assert np.isfinite(snap[0].view(np.float32)).all(), f"non-finite state after {where}"


def changed(new, old):
    return any(not np.array_equal(a, b) for a, b in zip(new, old))


def grad_scaler_schedule(finite, scale, growth_interval, min_scale, max_scale):
    """The loss scale after each step under PyTorch GradScaler's rule (factors 2 and 1/2), bounded.

    Grows on the growth_interval-th consecutive finite step, halves on every non-finite step.
    """
    counter, scales = 0, []
    for ok in finite:
        if ok:
            counter += 1
            if counter == growth_interval:
                scale, counter = min(scale * 2.0, max_scale), 0
        else:
            scale, counter = max(scale * 0.5, min_scale), 0
        scales.append(scale)
    return np.array(scales)


def run_lengths(flags):
    """Lengths of the runs of True in a bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    return edges[1::2] - edges[::2]


# ------------------------------------------------------------------ 1. fault injection

FAULT_KINDS = ("loss inf", "loss nan", "loss -inf", "image nan", "image inf", "image -inf")


def fault_schedule(num_steps, seed):
    """Calm stretches (the scale grows back, often to its maximum) between storms of isolated
    faults and runs of up to 10 in a row (the scale falls, often to its minimum)."""
    rng = np.random.default_rng(seed)
    faults = np.zeros(num_steps, bool)
    t = 0
    while t < num_steps:
        t += int(rng.integers(30, 200))
        storm_end = t + int(rng.integers(10, 60))
        while t < storm_end:
            run = int(rng.choice([1, 1, 1, 2, 3, 5, 7, 10]))
            faults[t : t + run] = True
            t += run + int(rng.integers(1, 5))
    return faults


def inject(batch, kind, row):
    value = np.float32(float(kind.split()[1]))
    if kind.startswith("loss"):
        return {**batch, "poison": value}
    image = batch["image"].copy()
    image[row % len(image), 3, 4, 0] = value  # one pixel of one image
    return {**batch, "image": image}


def test_train_step_injected_overflows_each_cost_one_skipped_step_and_nothing_else():
    num_steps, batch_size, shape = 1200, 8, (8, 8, 1)
    faults = fault_schedule(num_steps, seed=4)
    initial, interval, lo, hi = 2.0**10, 20, 2.0**4, 2.0**12
    expected_scale = grad_scaler_schedule(~faults, initial, interval, lo, hi)
    scale_used = np.concatenate([[initial], expected_scale[:-1]])  # the scale each step ran at
    # The schedule exercises what it should: hundreds of faults, long runs of them, many growths,
    # both bounds.
    assert faults.sum() >= 200 and (run_lengths(faults) >= 5).sum() >= 10
    assert run_lengths(faults).max() == 10
    assert (expected_scale > scale_used).sum() >= 30
    assert (expected_scale == hi).any() and (expected_scale == lo).any()

    # A two-block ResNet from jamp.models: convolutions, projection shortcut, 6 BatchNorms.
    model = jamp.wrap(ResNet(stage_sizes=(1, 1), num_filters=4), "mixed_float16")
    tx = optax.adam(1e-3)
    loss_scale = DynamicLossScale(
        initial, growth_interval=interval, min_loss_scale=lo, max_loss_scale=hi
    )
    clean = batches_of(*synthetic_images(25 * batch_size, shape, seed=0), batch_size)
    step = jax.jit(jamp.make_train_step(make_loss_fn(model), tx))
    state = initial = init_state(model, tx, loss_scale, shape)
    before, skipped, losses = kept(state), 0, []
    for t in range(num_steps):
        batch, where = clean[t % len(clean)], f"step {t} (clean)"
        if faults[t]:
            kind = FAULT_KINDS[skipped % len(FAULT_KINDS)]
            batch, where = inject(batch, kind, skipped), f"step {t} ({kind})"
            skipped += 1
        state, metrics = step(state, batch, KEY)
        metrics, after = jax.device_get(metrics), kept(state)
        assert_all_finite(after, where)
        # Exactly the injected steps are skipped: no natural overflow at these scales.
        assert bool(metrics["grads_finite"]) == (not faults[t]), where
        assert int(metrics["skipped_steps"]) == skipped == int(state.skipped_steps), where
        assert float(metrics["loss_scale"]) == expected_scale[t], where
        if faults[t]:
            assert_bit_identical(after, before, where)
        else:
            assert changed(after, before), where
            losses.append(float(metrics["loss"]))
        before = after
    assert skipped == faults.sum() and int(state.step) == num_steps
    assert np.mean(losses[-50:]) < 0.5 * np.mean(losses[:10])  # it learned through the storms

    # The same clean batches without the faults, each at the scale the faulty run used for it,
    # end in the same state bit for bit: the faults took nothing but their own steps.
    reference = initial
    for t in np.flatnonzero(~faults):
        reference, _ = step(with_scale(reference, scale_used[t]), clean[t % len(clean)], KEY)
    assert_bit_identical(kept(reference), kept(state), "the fault-free reference run")
    assert step._cache_size() == 1  # every kind of fault ran in the one compiled step


# ------------------------------------------------------------------ 2. natural overflow


def train_digits(loss_scale, num_steps):
    """Trains the BatchNorm MLP in fp16 on digits; returns per-step metrics and eval accuracy."""
    (train_x, train_y), (eval_x, eval_y) = digits()
    model = jamp.wrap(BNMLP(), "mixed_float16")
    tx = optax.adam(3e-3)
    batches = batches_of(train_x, train_y, 64)
    step = jax.jit(jamp.make_train_step(make_loss_fn(model), tx))
    state = init_state(model, tx, loss_scale, (8, 8, 1))
    history = []
    for t in range(num_steps):
        state, metrics = step(state, batches[t % len(batches)], KEY)
        history.append(metrics)
    history = jax.device_get(history)
    logits = model.apply({"params": state.params, **state.model_state}, eval_x)
    return history, float(np.mean(np.argmax(logits, -1) == eval_y))


def test_dynamic_loss_scale_backs_off_from_an_absurd_scale_then_trains_like_the_default():
    num_steps, absurd, default = 300, 2.0**40, 2.0**16
    history, accuracy = train_digits(DynamicLossScale(absurd, max_loss_scale=absurd), num_steps)
    finite = np.array([bool(m["grads_finite"]) for m in history])
    scales = np.array([float(m["loss_scale"]) for m in history])
    backoffs = int(np.argmax(finite))  # steps skipped before the first finite one
    np.testing.assert_array_equal(scales[:backoffs], absurd * 0.5 ** np.arange(1, backoffs + 1))
    # The scale never grows in this run (growth_interval 2000), so every skip halves it once: the
    # skips number log2(absurd / final scale). The scale that works is found no lower than the
    # default start, so at most log2(2**40 / 2**16) = 24 steps are skipped in all.
    skipped = int(history[-1]["skipped_steps"])
    assert (~finite).sum() == skipped == math.log2(absurd / scales[-1])
    assert scales[-1] >= default and 1 <= backoffs <= skipped <= math.log2(absurd / default)
    # Past the first back-off, an overflow is a lone step at the edge of the workable range.
    assert run_lengths(~finite[backoffs:]).max(initial=0) == 1

    ref_history, ref_accuracy = train_digits(DynamicLossScale(default), num_steps)
    assert all(bool(m["grads_finite"]) for m in ref_history)
    final_loss = np.mean([float(m["loss"]) for m in history[-30:]])
    ref_final_loss = np.mean([float(m["loss"]) for m in ref_history[-30:]])
    assert ref_accuracy > 0.9
    assert abs(accuracy - ref_accuracy) <= 0.03
    assert abs(final_loss - ref_final_loss) <= 0.02


# ------------------------------------------------------------------ 3. non-finite inputs

POLICY_CASES = [
    ("float32", NoOpLossScale()),
    ("mixed_bfloat16", NoOpLossScale()),
    ("mixed_float16", DynamicLossScale(2.0**10)),
    ("mixed_float16", StaticLossScale(2.0**8)),
    ("mixed_float16", NoOpLossScale()),
]


@pytest.mark.parametrize(
    "policy, loss_scale",
    POLICY_CASES,
    ids=[f"{p}-{type(ls).__name__}" for p, ls in POLICY_CASES],
)
def test_train_step_nonfinite_input_batch_is_skipped_under_every_policy(policy, loss_scale):
    (train_x, train_y), _ = digits()
    clean = batches_of(train_x, train_y, 32)[:30]
    bad_at = {5: np.nan, 6: np.inf, 12: -np.inf}  # two in a row, then one alone
    model = jamp.wrap(BNMLP(), policy)
    tx = optax.adam(3e-3)
    step = jax.jit(jamp.make_train_step(make_loss_fn(model), tx))
    state = initial = init_state(model, tx, loss_scale, (8, 8, 1))
    before, used, losses, skipped = kept(state), [], [], 0
    for t, batch in enumerate(clean):
        while t + skipped in bad_at:  # a bad batch comes between two clean ones
            value = bad_at[t + skipped]
            image = batch["image"].copy()
            image[skipped, 2, 3, 0] = value
            where = f"{value} input at step {t + skipped}"
            state, metrics = step(state, {**batch, "image": image}, KEY)
            skipped += 1
            assert not bool(metrics["grads_finite"]), where
            assert int(metrics["skipped_steps"]) == skipped, where
            assert_bit_identical(kept(state), before, where)
        used.append(float(state.loss_scale.loss_scale))
        state, metrics = step(state, batch, KEY)
        before = kept(state)
        assert bool(metrics["grads_finite"]), f"clean step {t}"
        assert_all_finite(before, f"clean step {t}")
        losses.append(float(metrics["loss"]))
    assert int(state.skipped_steps) == len(bad_at) and int(state.step) == len(clean) + len(bad_at)
    assert np.mean(losses[-5:]) < 0.5 * losses[0]
    # The clean batches alone, each at the scale the run above used, end in the same state.
    reference = initial
    for scale, batch in zip(used, clean):
        reference, _ = step(with_scale(reference, scale), batch, KEY)
    assert_bit_identical(kept(reference), kept(state), "the reference run without bad batches")


# ------------------------------------------------------------------ 4. bounds

BOUND_CASES = {
    "defaults-like": dict(loss_scale=2.0**15, growth_interval=3),
    "odd-factors-hysteresis": dict(
        loss_scale=7.0,
        growth_interval=2,
        growth_factor=3.0,
        backoff_factor=0.3,
        hysteresis=2,
        min_loss_scale=3.0,
        max_loss_scale=1000.0,
    ),
    "min-equals-max": dict(
        loss_scale=5.0, growth_interval=1, min_loss_scale=5.0, max_loss_scale=5.0
    ),
    # Products leave fp32's range: 1e30 * 1e10 is inf in fp32, 1e-30 * 1e-10 is 0.
    "products-overflow-fp32": dict(
        loss_scale=1e30,
        growth_interval=1,
        growth_factor=1e10,
        backoff_factor=1e-10,
        min_loss_scale=1e-30,
        max_loss_scale=3e38,
    ),
    # Neither 0.1 nor 0.7 is an fp32 number.
    "bounds-not-in-fp32": dict(
        loss_scale=0.1, growth_interval=4, hysteresis=3, min_loss_scale=0.1, max_loss_scale=0.7
    ),
}


def bursty_finite_flags(seed, num_steps=4000):
    """Calm stretches (1 % overflows) and storms (70 %), switching with probability 3 % a step."""
    rng = np.random.default_rng(seed)
    switches = np.cumsum(rng.random(num_steps) < 0.03) % 2 == 1
    return rng.random(num_steps) >= np.where(switches, 0.7, 0.01)


def hysteresis_reference(finite, ls):
    """The documented update rule, in fp32 numpy arithmetic (as the device computes it)."""
    f32 = np.float32
    scale, lo, hi = f32(ls.loss_scale), f32(ls.min_loss_scale), f32(ls.max_loss_scale)
    counter, left, scales = 0, ls.hysteresis, []
    with np.errstate(over="ignore", under="ignore"):
        for ok in finite:
            if ok:
                counter += 1
                if counter >= ls.growth_interval:
                    scale, counter, left = min(scale * f32(ls.growth_factor), hi), 0, ls.hysteresis
            else:
                counter, left = 0, max(left - 1, 0)
                if left <= 0:
                    scale = max(scale * f32(ls.backoff_factor), lo)
            scales.append(scale)
    return np.array(scales, np.float32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", BOUND_CASES)
def test_dynamic_loss_scale_stays_within_bounds_over_long_random_sequences(case, seed):
    ls = DynamicLossScale(**BOUND_CASES[case])
    finite = bursty_finite_flags(seed)

    @jax.jit
    def trajectory(ls, finite):
        def body(ls, ok):
            ls = ls.adjust(ok)
            return ls, ls.loss_scale

        return jax.lax.scan(body, ls, finite)[1]

    scales = np.asarray(trajectory(ls, jnp.asarray(finite)))
    # The bounds hold as fp32 numbers, the dtype the scale lives in.
    lo, hi = np.float32(ls.min_loss_scale), np.float32(ls.max_loss_scale)
    assert np.isfinite(scales).all() and (scales > 0).all()
    assert scales.min() == lo and scales.max() == hi  # reached both, never passed either
    np.testing.assert_array_equal(scales, hysteresis_reference(finite, ls))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_loss_scale=1e39), "max_loss_scale"),  # fp32 inf: the scale would stick at inf
        (dict(loss_scale=1.0, min_loss_scale=1e-50), "min_loss_scale"),  # fp32 0: stuck at 0
        (dict(loss_scale=1.0, min_loss_scale=1e-40), "min_loss_scale"),  # subnormal in fp32
    ],
)
def test_dynamic_loss_scale_rejects_bounds_outside_fp32(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DynamicLossScale(**kwargs)


@pytest.mark.parametrize("value", [1e39, 1e-50])
def test_static_loss_scale_rejects_scales_outside_fp32(value):
    with pytest.raises(ValueError, match="fp32"):
        StaticLossScale(value)


# ------------------------------------------------------------------ 5. persistent overflow


def step_metrics(finite, scale, skipped):
    return {
        "grads_finite": np.bool_(finite),
        "loss_scale": np.float32(scale),
        "skipped_steps": skipped,
    }


def test_overflow_watch_counts_skips_only_at_the_floor_of_a_dynamic_scale():
    watch = OverflowWatch(DynamicLossScale(8.0, min_loss_scale=2.0), limit=3)
    window = [step_metrics(False, 4.0, 1)]  # backing off: not counted
    window += [step_metrics(False, 2.0, 2), step_metrics(False, 2.0, 3)]  # at the floor
    assert watch.update(window, 3) is None and watch.streak == 2
    message = watch.update([step_metrics(False, 2.0, 4)], 4)
    assert message.startswith("step 4: the last 3 steps") and "4 steps skipped in all" in message
    assert "at 2," in message
    # Reported again only once the streak has grown by another `limit` steps.
    assert watch.update([step_metrics(False, 2.0, 5), step_metrics(False, 2.0, 6)], 6) is None
    assert watch.update([step_metrics(False, 2.0, 7)], 7).startswith("step 7: the last 6")
    # A finite step ends the streak; the next one starts from zero.
    assert watch.update([step_metrics(True, 2.0, 7), step_metrics(False, 2.0, 8)], 9) is None
    assert watch.streak == 1


def test_overflow_watch_counts_every_skip_of_a_static_or_no_scale():
    for loss_scale, scale in ((StaticLossScale(2.0**8), 2.0**8), (NoOpLossScale(), 1.0)):
        watch = OverflowWatch(loss_scale, limit=2)
        assert watch.update([step_metrics(False, scale, 1)], 1) is None
        assert watch.update([step_metrics(False, scale, 2)], 2) is not None


def test_overflow_watch_compares_the_floor_in_fp32():
    watch = OverflowWatch(DynamicLossScale(0.1, min_loss_scale=0.1), limit=1)
    assert watch.update([step_metrics(False, np.float32(0.1), 1)], 1) is not None


def _args(workdir, *extra):
    """The training program on small synthetic images; every step overflows unless `extra`
    changes the loss scale: a static scale of 1e30 overflows fp16 on every backward pass."""
    return [
        "--config=configs/synthetic.py:smoke",
        f"--workdir={workdir}",
        "--config.image_shape=(8, 8, 1)",
        "--config.batch_size=8",
        "--config.log_every_steps=2",
        "--config.eval_every_steps=1000",
        "--config.checkpoint_every_steps=1000",
        "--config.persistent_overflow_steps=5",
        "--config.loss_scale=static",
        "--config.loss_scale_params.initial=1e30",
        *extra,
    ]


def _cli(workdir, *extra):
    return forked_cli(_args(workdir, *extra))


def _train_records(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.program
@pytest.mark.parametrize(
    "extra, stop_step, streak, scale",
    [
        # Static: every skip counts; 5 reached at step 5, noticed at the log point at step 6.
        ([], 6, 6, "1e+30"),
        # Dynamic from 1e30 down to a floor of 1e25: steps 1-16 back off (not counted), step 17
        # reaches the floor, the streak is 5 at step 21 and noticed at the log point at step 22.
        (
            [
                "--config.loss_scale=dynamic",
                "--config.loss_scale_params.min_scale=1e25",
                "--config.loss_scale_params.max_scale=1e30",
            ],
            22,
            6,
            "1e+25",
        ),
    ],
    ids=["static", "dynamic-at-min"],
)
def test_train_persistent_overflow_stops_with_one_line_and_exit_status_3(
    extra, stop_step, streak, scale, tmp_path
):
    workdir = tmp_path / "run"
    out = _cli(workdir, "--config.num_train_steps=200", *extra)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == out.stderr.strip().splitlines()[-1]
    error = errors[0]
    assert error.startswith(f"error: training stopped at step {stop_step}: the last {streak} ")
    assert f"loss scale at {scale}" in error and f"({stop_step} steps skipped in all)" in error
    for advice in ("mixed_bfloat16", "learning_rate", "max_grad_norm", "nan/inf"):
        assert advice in error
    records = _train_records(workdir)
    assert records[-1]["step"] == stop_step and records[-1]["skipped_steps"] == stop_step
    assert "skipped steps" not in out.stdout  # no summary table: the run did not finish


@pytest.mark.program
def test_train_persistent_overflow_warn_warns_and_finishes(tmp_path):
    workdir = tmp_path / "run"
    out = _cli(workdir, "--config.num_train_steps=24", "--config.on_persistent_overflow=warn")
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [
        line
        for line in out.stderr.splitlines()
        if line.startswith("warning:") and "skipped" in line  # not the hardware's line
    ]
    # At the log points where the streak first reaches 5, 10, 15, 20 steps (it is 6, 12, 18, 24).
    assert [w.split(":")[1].strip() for w in warnings] == [f"step {s}" for s in (6, 12, 18, 24)]
    assert all("on_persistent_overflow=warn" in w and "mixed_bfloat16" in w for w in warnings)
    assert _train_records(workdir)[-1]["skipped_steps"] == 24
    assert "skipped steps" in out.stdout  # the summary table of a finished run


@pytest.mark.program
@pytest.mark.parametrize(
    "arg, needle",
    [
        ("--config.on_persistent_overflow=sometimes", "on_persistent_overflow"),
        ("--config.persistent_overflow_steps=0", "persistent_overflow_steps"),
    ],
)
def test_train_persistent_overflow_config_rejects_bad_values(arg, needle, tmp_path, forked_cli):
    out = forked_cli(_args(tmp_path / "run", arg))
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in out.stderr


# ------------------------------------------------------------------ which module overflowed


def test_overflow_log_counts_the_modules_of_skipped_steps_only():
    from jamp.train.overflow_watch import OverflowLog, without_flags

    ok, bad = np.bool_(True), np.bool_(False)
    window = [
        {"grads_finite": ok, "grads_finite_by_module": {"a": ok, "b": ok}},
        {"grads_finite": bad, "grads_finite_by_module": {"a": ok, "b": bad}},
        # pmap: a device axis; the replicas agree, any False counts.
        {
            "grads_finite": np.array([False, False]),
            "grads_finite_by_module": {"a": np.array([0, 0]), "b": np.array([1, 1])},
        },
    ]
    log = OverflowLog()
    assert log.update(window, first_step=11) == [(12, ["b"]), (13, ["a"])]
    log.update(window[1:2], first_step=20)
    assert log.most_frequent() == "b (2 steps), a (1 step)"
    assert OverflowLog().most_frequent() is None
    assert "grads_finite_by_module" not in without_flags(window[0])


@pytest.mark.program
def test_train_names_the_one_module_that_overflows_in_fp16(tmp_path):
    # The seed CNN with its first convolution reparametrised as 1e4 * conv(x; w / 1e4): the same
    # forward pass, 1e4 times larger gradients there. Under mixed_float16 the dynamic scale
    # starts at 2**16 and backs off; until it has, only Conv_0's gradients overflow fp16.
    workdir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jamp.train",
            "--config=configs/default.py:smoke",
            f"--workdir={workdir}",
            "--config.policy=mixed_float16",
            "--config.model_config={'stem_multiplier': 1e4}",
            "--config.trace_nonfinite=true",
        ],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    overflows = [r for r in records if r["kind"] == "overflow"]
    assert overflows and all(r["grads_nonfinite"] == ["Conv_0"] for r in overflows)
    skipped = {r["step"] for r in overflows}
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["skipped_steps"] == len(skipped)
    counted = sum(r.get("nonfinite/Conv_0", 0) for r in train) + (1 in skipped)
    assert counted == len(skipped)  # step 1 (the compile) is logged as an event only
    assert not [
        k for r in train for k in r if k.startswith("nonfinite/") and k != "nonfinite/Conv_0"
    ]
    # trace_nonfinite re-ran each skipped batch: the forward pass was finite every time.
    traces = [r for r in records if r["kind"] == "overflow_trace"]
    assert {r["step"] for r in traces} == skipped
    assert all(r["forward_nonfinite"] == [] for r in traces)
    assert "non-finite gradients in Conv_0" in out.stderr
    assert "forward pass finite" in out.stderr
    summary = [line for line in out.stdout.splitlines() if line.startswith("overflowing modules")]
    assert summary and summary[0].split()[2] == "Conv_0"


@pytest.mark.program
def test_train_trace_nonfinite_rejects_a_non_bool(tmp_path):
    out = _cli(tmp_path / "run", "--config.trace_nonfinite=maybe")
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "trace_nonfinite" in lines[0]
