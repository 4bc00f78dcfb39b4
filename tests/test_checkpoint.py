"""Tests for jamp.train.checkpoint: exact round trips, retention, damaged and foreign checkpoints, and
saves that fail or are interrupted."""

import asyncio
import functools
import gc
import logging
import os
import shutil
import sys
import time
import weakref
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jamp.loss_scale import DynamicLossScale, NoOpLossScale
from jamp.state import TrainState
from jamp.train.checkpoint import Checkpointer, CheckpointError

# When a read fails, Orbax's reader leaves a callback for an event loop it has closed; Python
# reports it ("Event loop is closed") at some later garbage collection, in whichever test runs then.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class _Net(nn.Module):
    features: int = 5
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(self.features, param_dtype=self.param_dtype)(x)
        return nn.BatchNorm(use_running_average=not train, param_dtype=self.param_dtype)(x)


def _loss_scale():
    # Every static setting differs from the defaults, so a restore that dropped them would show.
    return DynamicLossScale(
        2.0**10,
        growth_interval=3,
        growth_factor=4.0,
        backoff_factor=0.25,
        hysteresis=2,
        min_loss_scale=2.0,
        max_loss_scale=2.0**20,
    )


def _fresh_state(features=5, loss_scale=None, param_dtype=jnp.float32):
    variables = _Net(features, param_dtype).init(jax.random.key(0), jnp.ones((2, 3)))
    return TrainState.create(
        variables["params"],
        optax.adam(1e-3),
        model_state={"batch_stats": variables["batch_stats"]},
        loss_scale=_loss_scale() if loss_scale is None else loss_scale,
    )


def _trained_state(seed=1, loss_scale=None):
    """A state whose every leaf differs from a fresh one: as if it had trained for 7 steps."""
    state = _fresh_state(loss_scale=loss_scale)
    keys = iter(jax.random.split(jax.random.key(seed), 100))

    def noise(x):
        return x + jax.random.normal(next(keys), x.shape, x.dtype)

    tx = optax.adam(1e-3)
    grads = jax.tree_util.tree_map(noise, state.params)
    _, opt_state = tx.update(grads, state.opt_state, state.params)
    ls = state.loss_scale
    for finite in (False, True, True, True, False):
        ls = ls.adjust(jnp.array(finite))
    return state.replace(
        step=jnp.asarray(7, jnp.int32),
        params=jax.tree_util.tree_map(noise, state.params),
        opt_state=opt_state,
        model_state=jax.tree_util.tree_map(noise, state.model_state),
        loss_scale=ls,
        skipped_steps=jnp.asarray(2, jnp.int32),
    )


def _assert_identical(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert isinstance(a, jax.Array)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _damage(step_dir: Path, how: str):
    """Damages one checkpoint the way a full disk, a bad copy or bit rot would."""
    item = step_dir / "default"
    if how == "data_deleted":
        for f in (item / "d").iterdir():
            f.unlink()
    elif how == "data_garbage":
        for f in (item / "d").iterdir():
            f.write_bytes(os.urandom(f.stat().st_size))
    elif how == "manifest_truncated":
        manifest = item / "manifest.ocdbt"
        manifest.write_bytes(manifest.read_bytes()[:10])
    elif how == "metadata_garbage":
        (item / "_METADATA").write_text("{not json")
    else:
        raise AssertionError(how)


@pytest.fixture
def state():
    return _trained_state()


def test_checkpointer_round_trip_is_bit_exact(tmp_path, state):
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(7, state) is True
        restored = ckpt.restore(_fresh_state())
    _assert_identical(restored, state)  # the treedef holds the loss scale's static settings
    ls = restored.loss_scale
    assert (ls.growth_interval, ls.growth_factor, ls.hysteresis) == (3, 4.0, 2)
    assert (float(ls.loss_scale), int(ls.counter), int(ls.hysteresis_left)) == (2.0**12, 0, 1)


def test_checkpointer_round_trip_noop_loss_scale_and_new_process(tmp_path):
    state = _trained_state(loss_scale=NoOpLossScale())
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(7, state)
    with Checkpointer(tmp_path / "ckpt") as ckpt:  # as a resumed run would open it
        assert ckpt.latest_step() == 7
        restored = ckpt.restore(_fresh_state(loss_scale=NoOpLossScale()))
    _assert_identical(restored, state)
    assert isinstance(restored.loss_scale, NoOpLossScale)


def test_checkpointer_restore_into_abstract_target(tmp_path, state):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, state)
        restored = ckpt.restore(jax.eval_shape(_fresh_state))
    _assert_identical(restored, state)


def test_checkpointer_max_to_keep_and_steps(tmp_path, state):
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, state.replace(step=jnp.asarray(step, jnp.int32)))
        assert ckpt.all_steps() == [20, 30]
        assert ckpt.latest_step() == 30
        assert sorted(p.name for p in tmp_path.iterdir()) == ["20", "30"]
        assert ckpt.save(30, state) is False  # never overwrites, never goes back
        assert ckpt.save(25, state) is False
        assert int(ckpt.restore(state).step) == 30
        assert int(ckpt.restore(state, step=20).step) == 20
        with pytest.raises(CheckpointError, match="no checkpoint at step 10 .* steps 20, 30$"):
            ckpt.restore(state, step=10)
    with pytest.raises(CheckpointError, match="^no checkpoint in "):
        Checkpointer(tmp_path / "empty").restore(state)


def test_checkpointer_async_save_survives_deleted_buffers(tmp_path, state):
    # The loop donates the state to the next step right after saving.
    copy = jax.tree_util.tree_map(jnp.copy, state)
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(7, copy, wait=False)
        for leaf in jax.tree_util.tree_leaves(copy):
            leaf.delete()
        ckpt.wait_until_finished()
        _assert_identical(ckpt.restore(_fresh_state()), state)


@pytest.mark.parametrize(
    "how", ["data_deleted", "data_garbage", "manifest_truncated", "metadata_garbage"]
)
def test_checkpointer_damaged_latest_falls_back(tmp_path, state, how, caplog):
    older = _trained_state(seed=2)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, older)
        ckpt.save(2, state)
    _damage(tmp_path / "2", how)
    with Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, "jamp.train.checkpoint"):
        assert ckpt.latest_step() == 2
        restored = ckpt.restore(_fresh_state())
        with pytest.raises(CheckpointError, match="^checkpoint at step 2 .* cannot be read"):
            ckpt.restore(_fresh_state(), step=2)  # an explicit step is never substituted
    _assert_identical(restored, older)
    assert "step 2" in caplog.text and "trying the previous one" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]  # nothing deleted


def test_checkpointer_names_the_array_it_cannot_read(tmp_path, caplog):
    # Large arrays are stored apart from the index: damage their data and only reads fail, each
    # wrapped by Orbax in "Encountered error while reading array index" and the whole
    # TensorStore spec; the warning gives the cause, which names the array.
    noise = np.random.default_rng(0).normal(size=(4, 256, 256))  # what zstd cannot shrink
    params = {f"w{i}": jnp.asarray(w, jnp.float32) for i, w in enumerate(noise)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, TrainState.create(params, optax.sgd(0.1)))
        ckpt.save(2, TrainState.create(params, optax.sgd(0.1)))
    data = [f for f in (tmp_path / "2").rglob("d/*") if f.stat().st_size > 100_000]
    assert data
    for f in data:
        raw = bytearray(f.read_bytes())
        raw[: len(raw) // 2] = bytes(len(raw) // 2)
        f.write_bytes(bytes(raw))
    with Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, "jamp.train.checkpoint"):
        restored = ckpt.restore(TrainState.create(params, optax.sgd(0.1)))
    assert int(restored.step) == 0
    warning = next(r.getMessage() for r in caplog.records if "step 2" in r.getMessage())
    assert 'Error reading "params.w' in warning, warning
    assert "TensorStore details" not in warning and "\n" not in warning


def test_checkpointer_all_damaged_raises_one_line(tmp_path, state):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
    _damage(tmp_path / "1", "data_deleted")
    _damage(tmp_path / "2", "manifest_truncated")
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(_fresh_state())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"none of the 2 checkpoints in {tmp_path} can be read")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def _orphaned_task_report(error: Exception, caplog) -> str:
    """What asyncio logs when a task failing with `error` is collected without being awaited."""
    loop = asyncio.new_event_loop()

    async def read():
        raise error

    try:
        task = loop.create_task(read())
        loop.run_until_complete(asyncio.sleep(0))
        caplog.clear()
        with caplog.at_level(logging.ERROR, "asyncio"):
            del task
            gc.collect()
    finally:
        loop.close()
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "asyncio")


def test_checkpointer_drops_orphaned_read_errors_after_a_failed_restore(tmp_path, state, caplog):
    # A damaged checkpoint's restore leaves unawaited sibling reads; whenever one is collected,
    # asyncio logs its error with a traceback (CI saw one in the CLI's stderr).
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    _damage(tmp_path / "1", "data_deleted")
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointError):
        ckpt.restore(_fresh_state())
    spec = "DATA_LOSS: Error reading \"x/.zarray\" [tensorstore_spec='{}']"
    assert _orphaned_task_report(ValueError(spec), caplog) == ""
    other = _orphaned_task_report(ValueError("a bug elsewhere"), caplog)
    assert "Task exception was never retrieved" in other and "a bug elsewhere" in other


def _abandon_in_a_closed_loop(make_coroutine, caplog, release=lambda: None) -> str:
    """Runs `make_coroutine()` until it waits, closes its loop (as a failed Orbax restore does),
    lets what it waits for end (`release`) and collects it, the one reference gone; returns what
    asyncio logged meanwhile."""
    loop = asyncio.new_event_loop()
    caplog.clear()
    with caplog.at_level(logging.ERROR, "asyncio"):
        task = loop.create_task(make_coroutine())
        loop.run_until_complete(asyncio.sleep(0))
        assert not task.done()
        loop.close()
        release()
        collected, task = weakref.ref(task), None
        deadline = time.monotonic() + 30  # tensorstore lets go of it once its read has ended
        while collected() is not None:
            assert time.monotonic() < deadline, "the abandoned task was never collected"
            gc.collect()
            time.sleep(0.01)
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "asyncio")


def test_checkpointer_drops_orbax_reads_abandoned_by_a_failed_restore(monkeypatch, caplog):
    # CI saw a process of a 2-process run stall: after its part of a checkpoint failed to read,
    # each pending read coroutine, collected later, printed "Exception ignored in <coroutine ...>"
    # with the array's whole TensorStore spec, tens of KB that filled its stderr pipe.
    import threading

    import tensorstore as ts
    from orbax.checkpoint._src.serialization import limits, serialization

    from jamp.train import stale_reads

    reached = []  # what the hook passes on to the one it replaced
    monkeypatch.setattr(sys, "unraisablehook", reached.append)
    stale_reads.ignore_stale_read_callbacks()
    released = threading.Event()

    def slow_read(domain, array, params):  # a read still in flight when the loop closes
        released.wait(30)
        array[...] = 0

    store = ts.virtual_chunked(slow_read, dtype=ts.float32, shape=[64, 64])
    read = functools.partial(  # Orbax's own reader, as a restore runs it
        serialization._read_array_index_and_device_put,
        [jax.devices()[0]],
        (slice(0, 64, 1), slice(0, 64, 1)),
        store,
        global_shape=(64, 64),
        new_shard_shape=(64, 64),
        dtype=None,
        byte_limiter=limits.get_byte_limiter(),
        strict=True,
        dll=None,
        memory_kind=None,
    )
    assert _abandon_in_a_closed_loop(read, caplog, released.set) == ""
    assert reached == []

    async def elsewhere():  # the same fate for anyone else's coroutine is still reported
        try:
            await asyncio.sleep(60)
        except BaseException as e:
            raise ValueError("a bug elsewhere") from e

    logged = _abandon_in_a_closed_loop(elsewhere, caplog)
    assert "Task was destroyed but it is pending!" in logged
    assert [str(u.exc_value) for u in reached] == ["a bug elsewhere"]


@pytest.mark.parametrize(
    "target, expected",
    [
        (
            lambda: _fresh_state(features=6),
            "params/BatchNorm_0/bias has shape (5,) in the checkpoint and (6,) here "
            "(and 13 more differences)",
        ),
        (
            lambda: _fresh_state(loss_scale=NoOpLossScale()),
            "loss_scale/counter is in the checkpoint but not in this model's state "
            "(and 2 more differences)",
        ),
        (
            lambda: _fresh_state(param_dtype=jnp.bfloat16),
            # the params alone: the optimizer's moments are float32 for bf16 params too
            "params/BatchNorm_0/bias has dtype float32 in the checkpoint and bfloat16 here "
            "(and 3 more differences)",
        ),
    ],
    ids=["shape", "structure", "dtype"],
)
def test_checkpointer_foreign_checkpoint_raises_one_line(tmp_path, state, target, expected):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, state)
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(target())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint at step 7 in {tmp_path} does not match this model: ")
    assert expected in message
    assert message.endswith("; use another --workdir or the original config")
    assert os.listdir(tmp_path) == ["7"]


def test_checkpointer_failed_save_keeps_previous_latest(tmp_path, state, monkeypatch):
    older = _trained_state(seed=2)
    ckpt = Checkpointer(tmp_path, max_to_keep=1)
    ckpt.save(1, older)

    async def fail(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "serialize", fail)
    with pytest.raises(CheckpointError) as info:
        ckpt.save(2, state)
    assert str(info.value) == (
        f"saving step 2 to {tmp_path} failed (OSError: No space left on device); "
        "step 1 is still the latest"
    )
    assert ckpt.latest_step() == 1
    _assert_identical(ckpt.restore(_fresh_state()), older)
    monkeypatch.undo()
    assert ckpt.save(2, state)  # the next try succeeds and only then retires step 1
    assert ckpt.all_steps() == [2]
    ckpt.close()


@pytest.mark.parametrize("wait", [True, False])
def test_checkpointer_save_killed_before_commit(tmp_path, state, monkeypatch, wait):
    from orbax.checkpoint._src.path import atomicity  # where Orbax renames tmp -> final

    older = _trained_state(seed=2)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, older)

        async def killed(*args, **kwargs):
            raise OSError("killed")

        monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", killed)
        if wait:
            with pytest.raises(CheckpointError, match="step 1 is still the latest$"):
                ckpt.save(2, state)
        else:  # the background write fails; the next call that waits says so
            assert ckpt.save(2, state, wait=False)
            with pytest.raises(CheckpointError) as info:
                ckpt.save(3, state)
            assert str(info.value) == (
                f"saving a checkpoint to {tmp_path} failed (OSError: killed); "
                "step 1 is still the latest"
            )
    assert (tmp_path / "2.orbax-checkpoint-tmp").is_dir()  # fully written, never committed
    monkeypatch.undo()
    with Checkpointer(tmp_path) as ckpt:  # the next run
        assert ckpt.all_steps() == [1]
        _assert_identical(ckpt.restore(_fresh_state()), older)
        assert ckpt.save(2, state)  # replaces the leftover tmp directory
        assert ckpt.all_steps() == [1, 2]
        _assert_identical(ckpt.restore(_fresh_state()), state)


def test_checkpointer_ignores_partial_tmp_directory(tmp_path, state):
    # What a process killed in the middle of writing step 3 leaves behind.
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
    partial = tmp_path / "3.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "2", partial)
    _damage(partial, "data_deleted")
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 2
        _assert_identical(ckpt.restore(_fresh_state()), state)


def test_checkpointer_restores_a_checkpoint_written_before_fp8_state_existed(tmp_path, state):
    """A TrainState saved by a jamp without the `fp8_state` field (the same tree minus it)."""
    from flax import struct

    @struct.dataclass
    class Before:  # TrainState as it was before fp8
        step: jax.Array
        params: dict
        opt_state: tuple
        model_state: dict
        loss_scale: DynamicLossScale
        skipped_steps: jax.Array

    fields = ("step", "params", "opt_state", "model_state", "loss_scale", "skipped_steps")
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, Before(**{f: getattr(state, f) for f in fields}))
        restored = ckpt.restore(_fresh_state())
    _assert_identical(restored, state)
    assert isinstance(restored, TrainState) and restored.fp8_state is None


def test_checkpointer_a_bf16_checkpoint_into_an_fp8_run_is_one_line(tmp_path, state):
    from jamp import fp8

    site = fp8.Site(jnp.zeros((3, 4)), jnp.ones(3))
    target = _fresh_state().replace(fp8_state=fp8.Fp8State({"Dense_0/dot_general": site}))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, state)
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(target)
    message = str(info.value)
    assert "\n" not in message and "does not match this model" in message
    want = "fp8_state/sites/Dense_0/dot_general/amax_history is in this model's state but not in"
    assert want in message


@pytest.mark.parametrize(
    "saved_dtype, wanted_dtype",
    [
        (jnp.bfloat16, jnp.bfloat16),  # restored as stored: the copies the update wrote
        (None, jnp.bfloat16),  # an older checkpoint, or one written without copies: made anew
        (jnp.bfloat16, None),  # a run that keeps none (adaptive precision turned on): dropped
        (jnp.bfloat16, jnp.float16),  # another compute dtype: made anew in it
    ],
)
def test_compute_params_restored_as_stored_or_made_from_the_params(
    tmp_path, saved_dtype, wanted_dtype
):
    params = {"d": {"kernel": jnp.arange(12.0).reshape(3, 4) / 7, "bias": jnp.ones(4)}}
    tx = optax.adam(1e-3)
    saved = TrainState.create(params, tx, compute_dtype=saved_dtype)
    if saved_dtype is not None:  # as a step may have written them: one ulp off the cast
        kernel = saved.compute_params["d"]["kernel"]
        nudged = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(kernel, jnp.uint16) + 1, kernel.dtype
        )
        saved = saved.replace(compute_params={"d": {"kernel": nudged, "bias": None}})
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, saved)
    target = TrainState.create(params, tx, compute_dtype=wanted_dtype)
    with Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(target)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    if wanted_dtype is None:
        assert restored.compute_params is None
        return
    got = restored.compute_params["d"]["kernel"]
    assert got.dtype == wanted_dtype and restored.compute_params["d"]["bias"] is None
    want = saved.compute_params["d"]["kernel"] if saved_dtype == wanted_dtype else None
    if want is None:
        want = params["d"]["kernel"].astype(wanted_dtype)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
