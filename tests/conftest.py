"""Test configuration: simulate 8 CPU devices so that pmap tests run on a machine without accelerators.

The flag must be set before jax is imported anywhere in the test process.
"""

import os

from subproc import xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
