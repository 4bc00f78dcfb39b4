"""A test run that stops at the first crashed worker, naming the test it was running.

Under pytest-xdist (`-n auto`, the README's test command) a worker that dies mid-test (XLA
aborting, a segfault) is replaced by default, and with `--dist loadfile` the replacement is
handed the same file again; a run was seen hanging idle for minutes after such a crash, which
in CI runs to its time limit. Here the first crash stops the run at once: the test is reported
as failed ("worker 'gw0' crashed while running '...'"), the other workers are killed (their
unfinished tests reported as not run to the end), and pytest exits non-zero. A test that hangs
is ended by pytest-timeout's limit (pyproject.toml), which ends its worker, the same way.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest

_PIDS = "jamp_worker_pids"
_crashed: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller: each worker writes its pid into one folder of this run's."""
    config = node.config
    if not hasattr(config, "_jamp_worker_pids"):
        config._jamp_worker_pids = tempfile.mkdtemp(prefix="jamp-test-workers-")
    node.workerinput[_PIDS] = config._jamp_worker_pids


def pytest_unconfigure(config):
    folder = getattr(config, "_jamp_worker_pids", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_configure(config):
    folder = getattr(config, "workerinput", {}).get(_PIDS)
    if folder:
        with open(os.path.join(folder, str(os.getpid())), "w"):
            pass


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if _crashed:  # a worker this hook stopped, not a crash of its own
        report.longrepr = (
            f"not run to the end: the run stopped when a worker crashed in {_crashed[0]}"
        )
        return
    _crashed.append(crashitem)
    config = sched.config
    report.longrepr = f"{report.longrepr}: the run stops here (tests/failfast.py)"
    dsession = config.pluginmanager.getplugin("dsession")
    if dsession is not None:
        dsession._max_worker_restart = 0  # no replacement for the stopped ones either
        dsession.shouldstop = f"a worker crashed while running {crashitem}"
    folder = getattr(config, "_jamp_worker_pids", None)
    for name in os.listdir(folder) if folder else ():
        try:
            os.kill(int(name), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass
