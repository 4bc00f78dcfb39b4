"""Compiling a lowered program with XLA dumping what it did: the texts jamp reads.

`compile_dumped(lowered, options)` compiles once with `xla_dump_to` a temporary directory (or
the caller's, when `options` name one: it keeps what XLA wrote) and returns the executable with
every text file this compile wrote there (the optimized program, the partitioned one when asked
for, the buffer assignment and live ranges of a GPU program). JAX's
persistent compilation cache is off meanwhile: an executable it served would not be compiled,
and so not dumped.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional


def compile_dumped(lowered, options: Optional[dict[str, Any]] = None, keep=None):
    """`(executable, {file name: text})` of `lowered.compile(...)` with XLA's dump on; with
    `keep` (file name endings or substrings), only the files that name one of them are read."""
    import jax  # here: only a compile needs it
    from jax.experimental.compilation_cache import compilation_cache

    from jamp import jax_compat

    cached = jax_compat.config_value("jax_enable_compilation_cache")
    with tempfile.TemporaryDirectory() as where:
        # A dump folder the caller names (options' xla_dump_to) is where XLA writes: what this
        # compile adds to it is read, and it keeps the files.
        folder = str((options or {}).get("xla_dump_to") or where)
        os.makedirs(folder, exist_ok=True)
        before = {e.name: e.stat().st_mtime_ns for e in os.scandir(folder)}
        # The cache decides once whether it is in use; reset, it decides again at the next compile.
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            executable = lowered.compile(
                compiler_options={**(options or {}), "xla_dump_to": folder}
            )
        finally:
            jax.config.update("jax_enable_compilation_cache", cached)
            compilation_cache.reset_cache()
        files = {}
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            name = entry.name
            if before.get(name) == entry.stat().st_mtime_ns:
                continue  # there before this compile, unchanged
            if name.endswith(".txt") and (keep is None or any(k in name for k in keep)):
                with open(entry.path) as f:
                    files[name] = f.read()
    return executable, files
