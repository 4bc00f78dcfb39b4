"""Compiling a lowered program with XLA dumping what it did: the texts jamp reads.

`compile_dumped(lowered, options)` compiles once with `xla_dump_to` a temporary directory and
returns the executable with every text file XLA wrote there (the optimized program, the
partitioned one when asked for, the buffer assignment and live ranges of a GPU program). JAX's
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

    cached = jax.config.jax_enable_compilation_cache
    with tempfile.TemporaryDirectory() as where:
        # The cache decides once whether it is in use; reset, it decides again at the next compile.
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            executable = lowered.compile(compiler_options={"xla_dump_to": where, **(options or {})})
        finally:
            jax.config.update("jax_enable_compilation_cache", cached)
            compilation_cache.reset_cache()
        files = {}
        for name in sorted(os.listdir(where)):
            if name.endswith(".txt") and (keep is None or any(k in name for k in keep)):
                with open(os.path.join(where, name)) as f:
                    files[name] = f.read()
    return executable, files
