"""jamp._startup: the CUDA plugin's start-up log lines are dropped from what native code writes
to stderr while JAX loads; anything else is passed on."""

import subprocess
import sys


def test_native_stderr_without_drops_the_noise_and_passes_the_rest_on():
    code = (
        "import os\n"
        "from jamp import _startup\n"
        "with _startup.native_stderr_without(_startup.NOISE):\n"
        "    os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called\\n')\n"
        "    os.write(2, b'I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine\\n')\n"
        "    os.write(2, b'something else\\n')\n"
        "os.write(2, b'after\\n')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[-2:] == ["something else", "after"]
    assert "InitializeLog" not in out.stderr and "cuda drivers" not in out.stderr


def test_import_jamp_loads_jax_once_without_driver_noise():
    out = subprocess.run(
        [sys.executable, "-c", "import jamp, jax; print(jax.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "InitializeLog" not in out.stderr and "cuda drivers" not in out.stderr
