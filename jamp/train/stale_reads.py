"""What a failed Orbax restore leaves behind, silenced: its abandoned reads' reports.

A restore that fails on one array closes its event loop while its other reads are still pending;
those report themselves later, at some garbage collection, long after `jamp.train.checkpoint`
handled the failure (tens of KB of TensorStore specs per restore). `ignore_stale_read_callbacks`
drops exactly those reports, process-wide, and passes every other one on.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

import orbax.checkpoint as ocp

# Orbax's own files: its read coroutines and tasks are recognised by where their code lives and
# by their names (`_read_array_index_and_device_put`, `async_deserialize`): a save's are kept.
_ORBAX_DIR = os.path.dirname(os.path.abspath(ocp.__file__))
_READ_TASK = re.compile(r"coro=<(\w*(?:read|deserializ)\w*)\(\) .* at " + re.escape(_ORBAX_DIR))


def _is_orbax_read(name: str, filename: str) -> bool:
    return filename.startswith(_ORBAX_DIR) and ("read" in name or "deserializ" in name)


def ignore_stale_read_callbacks() -> None:
    """Silences the reports a failed Orbax read leaves behind (process-wide, once).

    When one array of a checkpoint cannot be read, Orbax's restore fails and closes its event
    loop while its other reads are still pending. Each of them is reported later, at some garbage
    collection, long after the failure was handled: tensorstore's callback into the closed loop
    ("RuntimeError: Event loop is closed"), and the read's coroutine, finalised while suspended,
    turning the GeneratorExit into "Encountered error while reading array index" with the
    array's whole TensorStore spec (a few KB each, tens of them per restore; in a multi-process
    run whose stderr goes to a pipe this filled the pipe and stalled the process). Python prints
    both kinds through `sys.unraisablehook`; only those are dropped, every other unraisable
    exception goes to the previous hook. asyncio's log of the same restore's orphaned reads is
    filtered too (`_drop_orphaned_read_errors`).
    """
    previous = sys.unraisablehook
    if getattr(previous, "_jamp_stale_reads", False):
        return

    def hook(unraisable):
        if not (_callback_into_closed_loop(unraisable) or _abandoned_orbax_read(unraisable)):
            previous(unraisable)

    hook._jamp_stale_reads = True  # type: ignore[attr-defined]  # a function attribute (mypy#2087)
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_drop_orphaned_read_errors)


def _callback_into_closed_loop(unraisable: Any) -> bool:
    exc, tb = unraisable.exc_value, unraisable.exc_traceback
    return (
        isinstance(exc, RuntimeError)
        and str(exc) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
    )


def _abandoned_orbax_read(unraisable: Any) -> bool:
    """An Orbax coroutine closed while suspended (its restore had already failed) that raised."""
    code = getattr(unraisable.object, "cr_code", None)
    return (
        code is not None
        and _is_orbax_read(code.co_name, code.co_filename)
        and isinstance(getattr(unraisable.exc_value, "__cause__", None), GeneratorExit)
    )


def _drop_orphaned_read_errors(record: logging.LogRecord) -> bool:
    """Drops asyncio's reports of a failed restore's leftover Orbax reads.

    The same failed restore leaves sibling read tasks whose own errors nobody awaits, and tasks
    still pending when its loop closed; asyncio logs each ("exception was never retrieved", with
    a traceback; "Task was destroyed but it is pending!") whenever the task happens to be garbage
    collected (so only sometimes). The restore has already failed and been reported by then. Any
    other asyncio record passes.
    """
    message = str(record.msg)
    first = message.partition("\n")[0]
    exc = record.exc_info[1] if record.exc_info else None
    if first.endswith("exception was never retrieved"):
        return not (exc is not None and "tensorstore_spec=" in str(exc))
    if first == "Task was destroyed but it is pending!":
        return _READ_TASK.search(message) is None
    return True
