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

# The suite's time is mostly XLA compiling small programs that then run for milliseconds, and
# most of a CPU compile is LLVM optimising the generated loops. Unoptimised machine code computes
# the same values (XLA:CPU emits no fast-math, and its matmuls and convolutions are library
# kernels either way) and takes about a third off test_fp8.py and test_sharding.py. It changes
# nothing a GPU-target test reads: the HLO passes, fusion, buffer assignment and collectives run
# before LLVM. Benchmarks and experiments run outside the tests keep XLA's default.
_FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for `devices` simulated CPU devices whose collectives wait patiently, compiled
    for compile time rather than run time."""
    return (
        f"--xla_force_host_platform_device_count={devices} {_PATIENT_COLLECTIVES} {_FAST_COMPILE}"
    )


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
    return loop.fresh_state(run, model, tx, dataset.info, adaptive_state)


# The server behind `ForkedCli`: imports the program once, then per request forks a child that
# runs it as `python -m jamp.train <args>` would (its own argv, stdout and stderr, exit status,
# and a normal interpreter exit: atexit handlers, thread joins and flushes run as in a fresh one).
_SERVER = r"""
import json, os, sys, tempfile, threading, traceback
sys.argv = ["jamp.train"]
# What the program prints while importing is caught here and replayed into every run's output,
# so a run's stderr is what a fresh process's would be; fd 1 is the replies' until then.
protocol = os.fdopen(os.dup(1), "w")
saved = {fd: os.dup(fd) for fd in (1, 2)}
caught = {fd: tempfile.TemporaryFile() for fd in (1, 2)}
for fd in (1, 2):
    os.dup2(caught[fd].fileno(), fd)
import jamp.train.cli as cli
from absl import logging
logging.use_absl_handler()  # as absl's app.run does before the program's main,
cli._quiet_logs()  # and what main sets before the imports below
import jamp.train.loop, jamp.train.data.digits  # what every run imports: paid once, not per run
sys.stdout.flush()
sys.stderr.flush()
noise = {}
for fd in (1, 2):
    caught[fd].seek(0)
    noise[fd] = caught[fd].read()
os.dup2(saved[2], 2)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing of the server's reaches the replies
assert threading.active_count() == 1, threading.enumerate()  # so that fork is safe
import jax._src.xla_bridge as xb
assert not xb._backends, "a JAX backend is up before the fork"
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(request["cwd"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                os.write(fd, noise[fd])
            sys.argv = ["jamp.train", *request["args"]]
            cli.run()
            code = 0
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
        sys.exit(code)  # out of the loop: the child's interpreter exits as a fresh one would
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), file=protocol, flush=True)
"""


class ForkedCli:
    """`python -m jamp.train` as a fork of one server process that has imported the program but
    started no JAX backend and no thread: each run parses its own command line, starts its own
    backend, trains (or fails) and exits with its own status, as a fresh process would; only the
    imports (~3 s a run here, paid by ~200 runs of the suite) are shared. Runs that need their
    own environment, a signal or a second process stay real subprocesses.
    """

    def __init__(self, devices: int, cwd, tmp_dir):
        import subprocess
        import sys

        self._cwd, self._tmp, self._count = str(cwd), tmp_dir, 0
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            cwd=self._cwd,
            env=cli_env(devices),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a run that hangs is killed with its server
        )

    def run(self, args, timeout: float = 600):
        import json
        import select
        import signal
        import subprocess

        self._count += 1
        out, err = (self._tmp / f"run{self._count}.{name}" for name in ("out", "err"))
        request = {"args": list(args), "cwd": self._cwd, "stdout": str(out), "stderr": str(err)}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        ready, _, _ = select.select([self._server.stdout], [], [], timeout)
        line = self._server.stdout.readline() if ready else ""
        if not line:
            os.killpg(self._server.pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(args, timeout, output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess(args, json.loads(line), _read(out), _read(err))

    @property
    def alive(self) -> bool:
        return self._server.poll() is None

    def close(self):
        if self.alive:
            self._server.stdin.close()
            self._server.wait(timeout=60)


def _read(path) -> str:
    return path.read_text() if path.exists() else ""


_SERVERS: dict = {}


def forked_cli(args, devices: int = 2, timeout: float = 600):
    """The CompletedProcess of `python -m jamp.train <args>` with `devices` simulated devices, run
    in the checkout by a `ForkedCli` (one server per device count, for the whole session)."""
    import atexit
    import pathlib
    import shutil
    import tempfile

    server = _SERVERS.get(devices)
    if server is None or not server.alive:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="jamp-forked-cli-"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        server = _SERVERS[devices] = ForkedCli(devices, pathlib.Path(__file__).parents[1], tmp)
        atexit.register(server.close)  # (atexit runs last-in first: before the rmtree)
    return server.run(args, timeout)
