"""What `import jamp` does before JAX loads (this module imports nothing of JAX's, and runs
`load_jax()` when imported, which `jamp/__init__.py` does first).

Without an NVIDIA driver, JAX's CUDA plugin (the `gpu-compile` extra, which `jamp.compile_for`
needs on a CPU machine) writes C++ log lines to stderr as JAX imports it: "Could not find cuda
drivers on your machine, GPU will not be used" and absl's "All log messages before
absl::InitializeLog() is called are written to STDERR", three times each with JAX 0.10. On a
machine with no GPU to miss they are noise, and they come before a program's own first line
(e.g. its one-line error). `load_jax()` imports JAX with those lines dropped; anything else
written to stderr meanwhile is passed on. With a driver, or with JAX already imported, it does
nothing. `start_backends()` does the same for the backends' start.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterable, Iterator

#: Lines of the CUDA plugin's start-up log on a machine without an NVIDIA driver.
NOISE = ("All log messages before absl::InitializeLog()", "Could not find cuda drivers")


def has_nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")


@contextlib.contextmanager
def native_stderr_without(noise: Iterable[str]) -> Iterator[None]:
    """Inside, what native code writes to file descriptor 2 is held back; on exit, its lines
    that contain none of `noise` are written out."""
    noise = tuple(noise)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not any(n in line for n in noise))
            if kept:
                os.write(2, kept.encode())


def load_jax() -> None:
    """Imports JAX, without the CUDA plugin's start-up log where no NVIDIA driver is present."""
    if "jax" in sys.modules or has_nvidia_driver():
        return
    with native_stderr_without(NOISE):
        import jax  # noqa: F401


def start_backends() -> None:
    """Starts JAX's backends (`jax.devices()`) without the CUDA plugin's log where no NVIDIA
    driver is present: some JAX releases (0.10.0) write "Could not find cuda drivers" when the
    backends start rather than on import. For a program that has set up what the backends read
    (flags, distributed initialisation) and is about to use them anyway."""
    import jax

    if has_nvidia_driver():
        jax.devices()
        return
    with native_stderr_without(NOISE):
        jax.devices()


load_jax()  # on import: `import jamp` imports this module before any that imports JAX

__all__ = ["NOISE", "has_nvidia_driver", "load_jax", "native_stderr_without", "start_backends"]
