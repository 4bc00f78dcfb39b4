"""Test configuration: simulate 8 CPU devices so that pmap tests run on a machine without accelerators.

The flag must be set before jax is imported anywhere in the test process.

The many runs of the training program (each a subprocess) compile the same small programs again
and again: one persistent compilation cache for the session, fresh each session, serves them all
(18 % off test_train.py + test_resume.py here). The subprocesses inherit it with the environment,
and so do pytest-xdist's workers (`-n auto --dist loadfile`, the README's test command: each file
on one worker, so that a file's module-scoped fixtures, compiled programs among them, are built
once).
"""

import atexit
import os
import shutil
import tempfile

import pytest
import subproc
from subproc import xla_flags

# The first crashed worker (or a test past its time limit) stops the whole run, naming the test.
pytest_plugins = ["failfast"]

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jamp-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many tests read jaxprs for 16-bit operands into dot_general. On a CPU without native bf16,
# jamp would lower mixed matmuls as float32 dots of widened 16-bit operands ("upcast"), so the
# suite pins the "native" form on every machine (subprocesses inherit it); tests/test_hardware.py
# exercises both forms explicitly. Set JAMP_MATMUL_LOWERING=auto to run the suite unpinned.
os.environ.setdefault("JAMP_MATMUL_LOWERING", "native")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): a worker per core, at most 4. Most of a test's time
    is XLA compiling on one thread, so on 2 cores two workers take 35 % off the suite; each
    worker holds JAX, TensorFlow and 8 simulated devices, so more than 4 buys little for memory."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu_compile` compile for an H200 (`jamp.compile_for`): they need the
    gpu-compile extra, JAX's CUDA plugin and the cuDNN it loads (without cuDNN, XLA writes
    attention out instead of fusing it, and the programs are not a GPU's). They skip without."""
    marked = [item for item in items if item.get_closest_marker("gpu_compile")]
    if not marked:
        return
    from jamp import target

    if not target.plugin_available():
        why = "JAX's CUDA plugin is not installed"
    elif not target.cudnn_available():
        why = "the CUDA plugin finds no cuDNN"
    else:
        return
    skip = pytest.mark.skip(reason=f"{why} (from a checkout: pip install -e '.[gpu-compile]')")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def forked_cli():
    """`forked_cli(args, devices=2)`: `subproc.forked_cli`, the training program's CompletedProcess
    from a fork of a process that has imported it."""
    return subproc.forked_cli
