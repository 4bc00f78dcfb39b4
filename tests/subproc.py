"""What the tests that run `python -m jamp.train` (or any JAX program) in a subprocess share."""

import os

# Up to 8 simulated devices on a 2-core (and shared) machine: XLA's CPU collectives may wait far
# longer for their threads than on an idle one, and by default abort the process when one is late
# (a rendezvous termination timeout; seen once in CI under load). Generous, but a real hang still
# fails within minutes.
_PATIENT_COLLECTIVES = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=300"
)


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for `devices` simulated CPU devices whose collectives wait patiently."""
    return f"--xla_force_host_platform_device_count={devices} {_PATIENT_COLLECTIVES}"


def cli_env(devices: int = 2) -> dict:
    """The environment for a CLI subprocess: CPU only, `devices` simulated devices, quiet TF."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def recipe_state(data_dir, overrides=None, recipe: str = "default"):
    """A fresh host TrainState of a recipe, built the way jamp.train.loop builds it (a restore target).

    `overrides` maps dotted config fields to values, as `--config.<field>=<value>` would.
    """
    import pathlib
    import runpy

    from jamp.models import model_task
    from jamp.train import adapting, loop
    from jamp.train.optim import make_optimizer

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / f"{recipe}.py"
    config = runpy.run_path(str(path))["get_config"]()
    config.data_dir = str(data_dir)
    for name, value in (overrides or {}).items():
        *parents, leaf = name.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    run, data_cfg, optim_cfg, _ = loop.parse_config(config)
    dataset, model = loop.build_model(run, data_cfg, model_task(run.model))
    tx, _ = make_optimizer(optim_cfg)
    adaptive_state = None
    if run.adaptive:
        static = loop.keep_in_float32(run, model, dataset.info)
        adaptive_state = adapting.Adapting(run, model, dataset.info, static).init_state()
    return loop.init_state(
        model, tx, run.loss_scale, dataset.info, run.seed, run.fp8, adaptive_state=adaptive_state
    )
