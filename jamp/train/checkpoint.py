"""Saving and restoring the whole `TrainState` with Orbax, for the training program.

A `Checkpointer` keeps the last few checkpoints of one run in a directory, one subdirectory per
step. What it adds to Orbax's `CheckpointManager`:

* `restore` takes the state the program just built as its target, so dtypes, shapes, shardings and
  every static part of the pytree (which loss scale, its configuration, the optimizer state's
  containers) come from the program, and only array values come from disk.
* A checkpoint from another config (other param names, shapes or dtypes) is refused with one line
  that names the first difference, before anything is read, instead of Orbax's silent casts or
  multi-line tracebacks.
* A damaged latest checkpoint (a file deleted, truncated or overwritten) is skipped with a logged
  warning and the one before it is restored; only when none can be read does `restore` fail.
  With `set_aside_damaged=True` (the training program) the skipped ones are then renamed to
  `<step>.corrupt/`, so that the resumed run can save those steps again.

Saving is atomic on local disks: Orbax writes `<step>.orbax-checkpoint-tmp/` and renames it to
`<step>/` only once everything is written, so a save that fails or is killed leaves a tmp directory
that is never listed, and the previous checkpoint stays the latest. Nothing here deletes or
rewrites a checkpoint except Orbax's `max_to_keep` cleanup after a successful save.

The library never imports this module (it needs orbax-checkpoint); the training program does.

Example:
    >>> ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3)
    >>> if ckpt.latest_step() is not None:
    ...     state = ckpt.restore(state)  # `state` from TrainState.create: the target
    >>> ckpt.save(int(state.step), state)
    >>> ckpt.close()
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jamp.copies import compute_copies, dtype_of
from jamp.state import TrainState
from jamp.train import stale_reads, stored_state
from jamp.train.stored_state import OPTIONAL_FIELDS

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or restored; the message is one line meant for the user."""


def _first_line(error: BaseException) -> str:
    # Orbax wraps a failed read in "Encountered error while reading array index: <index>. See
    # full TensorStore details: <the whole spec>"; its cause says which array and what is wrong.
    while str(error).startswith("Encountered error while reading") and error.__cause__:
        error = error.__cause__
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > 200:  # tensorstore errors spell out the whole spec
        text = text[:200] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _savable(leaf: Any) -> Any:
    """A leaf as Orbax saves it in a multi-process run.

    Orbax refuses arrays that live on one process's devices only (pmap's unreplicated state): those
    become host numpy arrays, which every process holds alike and process 0 writes. A global array
    over several processes' devices (a sharded state) stays as it is: every process writes its own
    shards, and a replicated one is written once.
    """
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return leaf
    return jax.device_get(leaf)


class _ReadFailure:
    """What `_handler()`'s restore returns instead of raising: the read error of this process."""

    def __init__(self, error: BaseException):
        self.error = error


def _handler() -> ocp.StandardCheckpointHandler:
    """Orbax's standard handler, whose restore returns a failed read instead of raising it.

    In a multi-process run Orbax ends every restore at a barrier of all processes. A sharded state
    is read shard by shard, each process reading its own, so damage may show on one process only;
    raised, its error would leave that process skipping the barrier and the others waiting at it.
    Returned, every process reaches the barrier and the processes then agree (`_agree`). The
    instance's method is replaced, not the class subclassed: Orbax records the handler's class in
    every checkpoint, and any Orbax reader should still recognize it.
    """
    handler = ocp.StandardCheckpointHandler()
    restore = handler.restore

    def restore_or_failure(*args, **kwargs):
        try:
            return restore(*args, **kwargs)
        except Exception as e:  # raised again by `_agree`, after the barrier
            return _ReadFailure(e)

    handler.restore = restore_or_failure
    return handler


def _agree(restored: Any) -> Any:
    """The restored tree if every process could read its part; else raises on every process."""
    failed = isinstance(restored, _ReadFailure)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(failed))
        if not failed and np.any(flags):
            others = ", ".join(str(i) for i in np.flatnonzero(flags))
            raise OSError(f"process {others} cannot read its part of it")
    if failed:
        raise restored.error
    return restored


class Checkpointer:
    """Saves and restores `TrainState`s in `directory`, keeping the newest `max_to_keep`.

    Steps are the checkpoint names: `directory/<step>/`. One run, one writer per directory. In a
    multi-process run every process makes a `Checkpointer` on the same (shared) directory and calls
    `save` and `restore` alike: Orbax synchronizes them. Process 0 writes host arrays and each
    process the shards of a sharded state it holds; each reads what its target places on its
    devices, and a checkpoint one process cannot read is skipped by all of them.

    Args:
        directory: where the checkpoints go; created if missing.
        max_to_keep: how many of the newest checkpoints to keep; older ones are deleted after each
            successful save. None keeps all.

    Example:
        >>> with Checkpointer("/tmp/run/checkpoints", max_to_keep=2) as ckpt:
        ...     ckpt.save(100, state)
        ...     restored = ckpt.restore(state)
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=_handler()
        )

    def latest_step(self) -> int | None:
        """The newest checkpoint's step (readable or not), or None if there is none.

        Includes a save started with `wait=False` that is still being written.
        """
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of all checkpoints in the directory, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: TrainState, *, wait: bool = True) -> bool:
        """Saves `state` as checkpoint `step`.

        Args:
            step: the checkpoint's name, normally `int(state.step)`.
            state: the host state: unreplicated (`jamp.parallel.unreplicate`), not pmapped; or a
                state on a mesh (`jamp.sharding.shard_state`), also one spanning several processes.
            wait: block until the checkpoint is on disk. With False only the copy of the arrays to
                host memory blocks (so the caller may donate or delete them right after); errors of
                the background write are raised by the next `save`, `wait_until_finished` or
                `close`.

        Returns:
            True if the checkpoint was written (or started), False if it was skipped because a
            checkpoint at `step` or a later step already exists (logged).

        Raises:
            CheckpointError: the save failed (after an earlier good checkpoint stayed the latest).
        """
        step = int(step)
        if jax.process_count() > 1:
            state = jax.tree.map(_savable, state)
        self.wait_until_finished()  # an earlier async save's failure is reported as that
        latest = self.latest_step()
        if latest is not None and step <= latest:
            # Orbax only appends: a step at or before the latest one would be dropped silently.
            logger.warning(
                "not saving step %d: %s already has a checkpoint at step %d",
                step,
                self.directory,
                latest,
            )
            return False
        try:
            self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
            if wait:
                self._manager.wait_until_finished()
        except Exception as e:
            self._recover()
            raise CheckpointError(self._save_failure(f"step {step}", e)) from e
        return True

    def _save_failure(self, what: str, error: BaseException) -> str:
        latest = self.latest_step()
        kept = f"step {latest} is still the latest" if latest is not None else "nothing was saved"
        return f"saving {what} to {self.directory} failed ({_first_line(error)}); {kept}"

    def _recover(self) -> None:
        # After a failed save Orbax's in-memory list of steps no longer matches the disk (it has
        # already forgotten the step it meant to delete); read it again.
        try:
            self._manager.wait_until_finished()
        except Exception:  # the failure being reported already
            pass
        self._manager.reload()

    def wait_until_finished(self) -> None:
        """Blocks until a save started with `wait=False` is on disk; raises CheckpointError."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._recover()
            raise CheckpointError(self._save_failure("a checkpoint", e)) from e

    def restore(
        self,
        target: TrainState,
        step: int | None = None,
        *,
        set_aside_damaged: bool = False,
        fit: Optional[Callable[[Any, Any], Any]] = None,
    ) -> TrainState:
        """Returns the checkpointed state, with the structure, dtypes and placement of `target`.

        Args:
            target: a state of the run being resumed, e.g. fresh from `TrainState.create` (host,
                unreplicated); its values are not used, and leaves may be `jax.ShapeDtypeStruct`s.
                The restored arrays have the target's shardings: `ShapeDtypeStruct`s with a
                mesh's shardings restore straight onto the mesh, each process reading its shards.
            step: which checkpoint; None means the latest readable one: a damaged newer one is
                skipped with a logged warning. An explicit step is never substituted.
            set_aside_damaged: once an older checkpoint has been restored, rename the damaged
                newer ones `<step>/` -> `<step>.corrupt/` (kept, never deleted), so that the run
                can save those steps again: Orbax never saves at or before its latest step.
            fit: `fit(target, stored_tree) -> target`, given each candidate checkpoint's tree
                metadata: the target made to hold what that checkpoint holds where the run
                allows it to differ (adaptive precision's fp8 site set); None: as it is.

        Raises:
            CheckpointError: no checkpoint exists, none can be read, the requested step is missing
                or damaged, or the checkpoint does not match `target` (other model or config).
        """
        self.wait_until_finished()
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step is not None:
            if int(step) not in steps:
                raise CheckpointError(
                    f"no checkpoint at step {step} in {self.directory}; there are steps "
                    f"{', '.join(map(str, steps))}"
                )
            steps = [int(step)]
        wanted = stored_state.leaf_specs(target)
        abstract = stored_state.abstract(target)
        # A damaged checkpoint's reads call back after failing.
        stale_reads.ignore_stale_read_callbacks()
        failures = []
        for candidate in reversed(steps):
            try:
                restored = self._restore_step(candidate, abstract, wanted, fit)
            except CheckpointError:
                raise
            except Exception as e:
                failures.append(_first_line(e))
                logger.warning(
                    "checkpoint at step %d in %s cannot be read (%s)%s",
                    candidate,
                    self.directory,
                    _first_line(e),
                    "; trying the previous one" if candidate != steps[0] else "",
                )
                continue
            if set_aside_damaged and failures:
                self._set_aside([s for s in steps if s > candidate])
            return restored
        if step is not None:
            raise CheckpointError(
                f"checkpoint at step {step} in {self.directory} cannot be read ({failures[0]})"
            )
        raise CheckpointError(
            f"none of the {len(steps)} checkpoints in {self.directory} can be read "
            f"(step {steps[-1]}: {failures[0]})"
        )

    def _set_aside(self, steps: list[int]) -> None:
        """Renames the checkpoints at `steps` to `<step>.corrupt/`, which Orbax does not list."""
        if jax.process_index() == 0:
            for step in steps:
                path = os.path.join(self.directory, str(step))
                aside, n = f"{path}.corrupt", 1
                while os.path.exists(aside):
                    aside, n = f"{path}.corrupt{n}", n + 1
                try:
                    os.rename(path, aside)
                except OSError as e:
                    raise CheckpointError(
                        f"checkpoint at step {step} in {self.directory} cannot be read nor moved "
                        f"aside ({_first_line(e)}); move it out of the way and run again"
                    ) from None
                logger.warning("moved the unreadable checkpoint at step %d to %s", step, aside)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(
                "jamp.train.checkpoint: damaged checkpoints set aside"
            )
        self._manager.reload()

    def _restore_step(self, step: int, abstract: Any, wanted: dict, fit=None) -> TrainState:
        stored = self._manager.metadata(step).item_metadata
        stored_tree = getattr(stored, "tree", stored)
        copies = getattr(abstract, "compute_params", None)
        held = stored_tree.get("compute_params") if isinstance(stored_tree, dict) else None
        if copies is None and held is None or stored_state.same_copies(held, copies):
            return self._restore_tree(step, abstract, wanted, stored_tree, fit)
        # The checkpoint holds other copies than the run keeps (none, or in another dtype: the
        # policy changed, or adaptive precision turned on): restore the rest, make them anew.
        placed = abstract.replace(compute_params=stored_state.as_stored(held, abstract.params))
        restored = self._restore_tree(
            step, placed, stored_state.leaf_specs(placed), stored_tree, fit
        )
        dtype = dtype_of(copies)
        made = None if dtype is None else compute_copies(restored.params, dtype)
        return restored.replace(compute_params=made)

    def _restore_tree(self, step: int, abstract: Any, wanted: dict, stored_tree, fit) -> TrainState:
        if fit is not None and stored_tree is not None:
            abstract = stored_state.abstract(fit(abstract, stored_tree))
            wanted = stored_state.leaf_specs(abstract)
        switched = stored_state.switched_on(abstract, stored_tree)
        if switched:  # e.g. adaptive precision turned on to resume a run that had it off
            fields = {f.name: getattr(abstract, f.name) for f in dataclasses.fields(abstract)}
            kept = {k: v for k, v in fields.items() if k not in switched}
            kept.update({k: None for k in switched if k in stored_tree})  # saved as None
            wanted = stored_state.leaf_specs(abstract.replace(**{k: None for k in switched}))
            mismatch = stored_state.describe_mismatch(stored_state.leaf_specs(stored_tree), wanted)
            if mismatch is None:
                restored = self._manager.restore(step, args=ocp.args.StandardRestore(kept))
                restored = {**_agree(restored), **{k: fields[k] for k in switched}}
                return abstract.replace(**restored)
        if isinstance(stored_tree, dict):
            for name in OPTIONAL_FIELDS:
                if getattr(abstract, name, None) is None and stored_tree.get(name):
                    raise CheckpointError(
                        f"checkpoint at step {step} in {self.directory} holds {name} (adaptive "
                        "precision's promotions); resume it with "
                        "--config.adaptive_precision=true, or use another --workdir"
                    )
        # Without the tree metadata (a damaged checkpoint) Orbax's own checks have to do.
        if stored_tree is not None:
            mismatch = stored_state.describe_mismatch(stored_state.leaf_specs(stored_tree), wanted)
            if mismatch is not None:
                raise CheckpointError(
                    f"checkpoint at step {step} in {self.directory} does not match this model: "
                    f"{mismatch}; use another --workdir or the original config"
                )
        older = stored_state.fields_added_since(abstract, stored_tree)
        if older:  # written before TrainState had these fields: restore the rest, keep the None
            fields = {f.name: getattr(abstract, f.name) for f in dataclasses.fields(abstract)}
            kept = {k: v for k, v in fields.items() if k not in older}
            restored = self._manager.restore(step, args=ocp.args.StandardRestore(kept))
            return abstract.replace(**_agree(restored))
        return _agree(self._manager.restore(step, args=ocp.args.StandardRestore(abstract)))

    def close(self) -> None:
        """Waits for a pending save and releases Orbax's threads; raises CheckpointError."""
        try:
            self.wait_until_finished()
        finally:
            self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception that is already on its way out
            self.close()
        except CheckpointError as e:
            logger.error("%s", e)
