"""Exact resume of `python -m jamp.train`: a run that is killed (SIGKILL), stopped (SIGTERM) or
finds a damaged checkpoint and is then resumed ends bit-identical to a run that was never
interrupted: params, optimizer state, batch statistics, every loss-scale field and the counters.

The real CLI runs in subprocesses on the offline default recipe (the seed CNN on digits, fp16 with
a dynamic loss scale that grows every 5 finite steps, so it backs off and grows during the run).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from subproc import cli_env, forked_cli, recipe_state

from jamp.train.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_STEPS = 40
EVERY = 10
TMP = ".orbax-checkpoint-tmp"  # where Orbax writes a checkpoint before renaming it to <step>

# Reading a damaged checkpoint leaves an Orbax callback for a closed event loop, reported at a
# later garbage collection (see test_checkpoint.py).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


OVERRIDES = {
    "num_train_steps": NUM_STEPS,
    "checkpoint_every_steps": EVERY,
    "log_every_steps": EVERY,
    "eval_every_steps": 1000,
    "max_checkpoints_to_keep": 10,
    "loss_scale_params.growth_interval": 5,
}


def _command(workdir: pathlib.Path, data_dir: pathlib.Path) -> list[str]:
    flags = [f"--config.{name}={value}" for name, value in OVERRIDES.items()]
    return [
        sys.executable,
        "-m",
        "jamp.train",
        "--config=configs/default.py",
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        *flags,
    ]


def _run(workdir, data_dir, check=True) -> subprocess.CompletedProcess:
    out = forked_cli(_command(workdir, data_dir)[3:])  # the interrupted runs are fresh processes
    if check:
        assert out.returncode == 0, out.stderr[-4000:]
    return out


def _names(workdir: pathlib.Path) -> list[str]:
    directory = workdir / "checkpoints"
    return [p.name for p in directory.iterdir()] if directory.is_dir() else []


def _steps(workdir: pathlib.Path) -> list[int]:
    return sorted(int(name) for name in _names(workdir) if name.isdigit())


def _interrupt(workdir, data_dir, when: tuple[str, ...], sig: signal.Signals):
    """Starts a run and sends it `sig` as soon as an entry named in `when` is in checkpoints/."""
    proc = subprocess.Popen(
        _command(workdir, data_dir),
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not set(when) & set(_names(workdir)) and proc.poll() is None:
            assert time.time() < deadline, f"no {when} appeared in time"
            time.sleep(0.002)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, stdout, stderr


def _resumed_from(stdout: str) -> int | None:
    found = re.findall(r"resuming from the checkpoint at step (\d+)", stdout)
    assert len(found) <= 1, stdout
    return int(found[0]) if found else None


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def target(data_dir):
    """A fresh TrainState of the recipe, built the way jamp.train.loop builds it: the restore target."""
    return recipe_state(data_dir, OVERRIDES)


def _restore(workdir, target, step=NUM_STEPS):
    with Checkpointer(workdir / "checkpoints") as ckpt:
        return ckpt.restore(target, step=step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir, target):
    """The uninterrupted run: its workdir and its final state."""
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    _run(workdir, data_dir)
    assert _steps(workdir) == [10, 20, 30, 40]
    return workdir, _restore(workdir, target)


def _assert_bit_identical(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    paths = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, b), a in zip(paths, jax.tree_util.tree_leaves(got)):
        assert a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path), strict=True
        )


@pytest.mark.program
def test_resume_reference_run_changes_the_loss_scale(reference, target):
    _, final = reference
    assert int(final.step) == NUM_STEPS
    assert int(final.skipped_steps) > 0  # the scale overflowed and backed off ...
    assert float(final.loss_scale.loss_scale) != float(target.loss_scale.loss_scale)  # ... and grew
    assert final.loss_scale.growth_interval == 5


@pytest.mark.program
def test_resume_after_sigkill_twice_is_bit_identical(tmp_path, data_dir, target, reference):
    workdir = tmp_path / "killed"
    # First while checkpoint 20 is being written (into Orbax's tmp directory, never committed;
    # or, if the poll comes too late, right after it is committed), then in the resumed run right
    # after checkpoint 30 is committed.
    resumed = None
    for when in [(f"20{TMP}", "20"), ("30",)]:
        code, stdout, _ = _interrupt(workdir, data_dir, when, signal.SIGKILL)
        assert code == -signal.SIGKILL
        assert _resumed_from(stdout) == resumed
        resumed = max(_steps(workdir))
        assert resumed < NUM_STEPS
    assert _steps(workdir) == [10, 20, 30]
    out = _run(workdir, data_dir)
    assert _resumed_from(out.stdout) == 30
    _assert_bit_identical(_restore(workdir, target), reference[1])


@pytest.mark.program
def test_resume_after_sigterm_starts_at_the_stop_step_and_is_bit_identical(
    tmp_path, data_dir, target, reference
):
    workdir = tmp_path / "terminated"
    code, stdout, stderr = _interrupt(workdir, data_dir, (str(NUM_STEPS // 2),), signal.SIGTERM)
    assert code == 0, stderr[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", stdout).group(1))
    # Usually a step or two after the checkpoint at NUM_STEPS // 2; on a busy machine the signal
    # can land as that very step ends, and the stop then coincides with the periodic save.
    assert NUM_STEPS // 2 <= stopped < NUM_STEPS
    assert max(_steps(workdir)) == stopped  # saved on the way out, whatever the period
    assert int(_restore(workdir, target, step=stopped).step) == stopped
    out = _run(workdir, data_dir)
    assert _resumed_from(out.stdout) == stopped
    _assert_bit_identical(_restore(workdir, target), reference[1])


def _damage(step_dir: pathlib.Path, how: str) -> None:
    """Damages one checkpoint as a full disk, a bad copy or bit rot would."""
    item = step_dir / "default"
    if how == "data_garbage":
        for f in (item / "d").iterdir():
            f.write_bytes(os.urandom(f.stat().st_size))
    elif how == "data_deleted":
        for f in (item / "d").iterdir():
            f.unlink()
    elif how == "manifest_truncated":
        manifest = item / "manifest.ocdbt"
        manifest.write_bytes(manifest.read_bytes()[:10])
    else:
        raise AssertionError(how)


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.program
@pytest.mark.parametrize(
    "damage, resumed",
    [
        ({40: "data_garbage"}, 30),  # the final checkpoint: the rerun must save step 40 again
        ({40: "data_deleted", 30: "manifest_truncated"}, 20),
    ],
    ids=["final", "two_latest"],
)
def test_resume_damaged_latest_falls_back_sets_it_aside_and_saves_again(
    tmp_path, data_dir, target, reference, damage, resumed
):
    workdir = tmp_path / "damaged"
    shutil.copytree(reference[0], workdir)
    for step, how in damage.items():
        _damage(workdir / "checkpoints" / str(step), how)
    damaged = {step: _files(workdir / "checkpoints" / str(step)) for step in damage}
    out = _run(workdir, data_dir)
    assert _resumed_from(out.stdout) == resumed
    assert "cannot be read" in out.stderr and "Traceback" not in out.stderr
    for step, files in damaged.items():  # kept as they were, out of Orbax's way
        assert _files(workdir / "checkpoints" / f"{step}.corrupt") == files
    assert _steps(workdir) == [10, 20, 30, 40]  # the damaged steps were saved again
    for step in damage:
        assert int(_restore(workdir, target, step=step).step) == step
    _assert_bit_identical(_restore(workdir, target), reference[1])


@pytest.mark.program
def test_resume_every_checkpoint_damaged_stops_with_one_line_and_changes_nothing(
    tmp_path, data_dir, reference
):
    workdir = tmp_path / "all_damaged"
    shutil.copytree(reference[0], workdir)
    for step, how in zip([10, 20, 30, 40], ["data_garbage", "data_deleted"] * 2):
        _damage(workdir / "checkpoints" / str(step), how)
    before = _files(workdir)
    out = _run(workdir, data_dir, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: none of the 4 checkpoints in ") and "can be read" in last
    assert _files(workdir) == before


def test_resume_checkpointer_sets_aside_only_after_a_good_restore(tmp_path, target):
    states = {step: target.replace(step=target.step + step) for step in (1, 2, 3)}
    with Checkpointer(tmp_path) as ckpt:
        for step, state in states.items():
            ckpt.save(step, state)
    _damage(tmp_path / "3", "data_deleted")
    _damage(tmp_path / "2", "manifest_truncated")
    with Checkpointer(tmp_path) as ckpt:
        assert int(ckpt.restore(target).step) == 1  # a plain restore changes nothing
        assert ckpt.all_steps() == [1, 2, 3]
        assert int(ckpt.restore(target, set_aside_damaged=True).step) == 1
        assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
        assert ckpt.save(2, states[2]) and ckpt.save(3, states[3])  # no longer skipped
        _assert_bit_identical(ckpt.restore(target), states[3])
    _damage(tmp_path / "3", "data_garbage")  # damaged again: a second name, nothing replaced
    with Checkpointer(tmp_path) as ckpt:
        assert int(ckpt.restore(target, set_aside_damaged=True).step) == 2
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["1", "2", "2.corrupt", "3.corrupt", "3.corrupt1"]
    for step in (1, 2):
        _damage(tmp_path / str(step), "data_deleted")
    with Checkpointer(tmp_path) as ckpt, pytest.raises(Exception, match="none of the 2"):
        ckpt.restore(target, set_aside_damaged=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # nothing readable: nothing moved
