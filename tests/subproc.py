"""What the tests that run `python -m jamp.train` in a subprocess share."""

import os


def cli_env(devices: int = 2) -> dict:
    """The environment for a CLI subprocess: CPU only, `devices` simulated devices, quiet TF."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env
