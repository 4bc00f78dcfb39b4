"""The training program: ``python -m jamp.train [--config=<recipe>[:smoke]] [--workdir=DIR]``.

A recipe is named (``--config=cifar10_resnet``: one of the recipes in the checkout's ``configs/``,
which an install carries as ``jamp/configs/``) or given as a path to a recipe file
(``--config=configs/cifar10_resnet.py``, ``--config=my_recipe.py``). Every config field can be
overridden on the command line, e.g. ``--config.policy=mixed_bfloat16`` or
``--config.loss_scale_params.growth_interval=500``. With no flags it runs
``configs/default.py`` (the seed CNN on offline digits, fp16 with a dynamic loss scale) in a fresh
directory under ``./runs/``. Mistakes in the command line or config end the program with one line
on stderr and exit status 2; nothing in the workdir is changed. A run whose steps keep being
skipped for non-finite gradients at the smallest loss scale stops with one line and exit status 3
(``--config.on_persistent_overflow=warn`` only warns).

A multi-process run starts the program once per process, each with the same config and --workdir
and ``--coordinator_address=HOST:PORT --num_processes=N --process_id=I`` (or only
``--distributed`` where JAX detects the cluster: SLURM, Open MPI, Kubernetes, Cloud TPU).
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import sys
import warnings
from typing import Any, NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

from jamp import _startup
from jamp.train import cli_help

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent  # jamp/
# An install carries the recipes as jamp/configs/ (pyproject.toml maps the checkout's configs/).
RECIPES_DIR = next(
    (
        d
        for d in (_PACKAGE / "configs", _PACKAGE.parent / "configs")
        if (d / "default.py").is_file()
    ),
    _PACKAGE / "configs",
)
DEFAULT_CONFIG = RECIPES_DIR / "default.py"
EXIT_USAGE = 2
EXIT_DIVERGED = 3  # training stopped making progress (see configs/default.py)
_LOG_NOISE = (
    "OpenCV is not installed",
    "Grain multiprocess worker profiling requires",
    "has no dataset_info.json",
)

# A multi-process run: jax.distributed joins the processes, and pmap then spans all their devices.
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    None,
    "HOST:PORT where process 0 serves the coordinator of a multi-process run, the same for every "
    "process (JAX also reads $JAX_COORDINATOR_ADDRESS).",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process: 0 .. num_processes - 1.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    False,
    "Join a multi-process run even without the three flags above, which JAX then detects from "
    "the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU).",
)


# Compile the recipe's step for GPUs instead of training it (jamp.train.plan).
_COMPILE_FOR = flags.DEFINE_string(
    "compile_for",
    None,
    "Compile the recipe's train step for a GPU target instead of training (h100, h200, b200; "
    "xN GPUs per host, e.g. h200x8; 'Mx h200x8' for M hosts): print its memory per device, "
    "GEMMs, attention and collectives, whether it fits, and the largest global batch that does. "
    "Nothing is allocated, no data is read; needs JAX's CUDA plugin (in a checkout of jamp: "
    "pip install -e '.[gpu-compile]'), not a GPU.",
)
_SEARCH_BATCH = flags.DEFINE_bool(
    "search_batch", True, "With --compile_for: search the largest global batch that fits."
)


def recipe_names() -> list[str]:
    """The recipes that `--config=<name>` can name."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.stem.startswith("_"))


def _recipe_path(value: str) -> str:
    """`--config`'s value with a recipe name (or `configs/<name>.py` outside a checkout) replaced
    by the path of the recipe jamp carries; a path that exists is left as it is."""
    spec, sep, variant = value.partition(":")
    path = pathlib.Path(spec)
    if path.exists():  # a file (or, for ml_collections to refuse, a directory) of the user's
        return value
    named = spec if not path.suffix and len(path.parts) == 1 else None
    if named is None and path.suffix == ".py" and path.parent == pathlib.Path("configs"):
        named = path.stem  # the README's configs/<name>.py, run outside a checkout
    if named is None or named not in recipe_names():
        if named is not None and not path.suffix:
            names = recipe_names()
            close = cli_help.did_you_mean(named, names)
            hint = f" (did you mean {close!r}?)" if close else ""
            _fail(
                f"unknown recipe {spec!r}{hint}; recipes: {', '.join(names)} "
                "(or give the path of a recipe file)"
            )
        return value
    return str(RECIPES_DIR / f"{named}.py") + sep + variant


def _resolve_recipe_args(argv: list[str]) -> list[str]:
    """argv with `--config=<name>` / `--config <name>` pointing at the recipe file."""
    out, it = [], iter(argv)
    for arg in it:
        if arg.startswith("--config="):
            arg = "--config=" + _recipe_path(arg[len("--config=") :])
        elif arg == "--config":
            out.append(arg)
            arg = _recipe_path(next(it, ""))
        out.append(arg)
    return out


def _define_flags():
    """Defines --config and --workdir. ml_collections loads the recipe and checks the
    --config.<field> overrides in sys.argv right here, so errors can surface at definition time."""
    config = config_flags.DEFINE_config_file(
        "config",
        str(DEFAULT_CONFIG),
        f"Recipe: a name ({', '.join(recipe_names())}) or a recipe file's path; "
        "':smoke' picks a tiny run of it.",
        lock_config=True,
    )
    workdir = flags.DEFINE_string(
        "workdir", None, "Where checkpoints and metrics go; rerun with the same one to resume."
    )
    return config, workdir


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def _one_line(e: Exception, last: bool = False) -> str:
    """The first (or last) non-empty line of an exception's message."""
    text = str(e)
    if isinstance(e, (KeyError, AttributeError)):  # their str() adds layers of quotes
        text = text.strip("\"' ")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return lines[-1] if last else lines[0]


def _parse_flags(argv: list[str]) -> list[str]:
    """Parses flags; a bad flag or config file is one line, not absl's usage dump."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        if "Error whilst parsing config file" in str(e):  # get_config() raised; reason comes last
            _fail(f"cannot load the config: {_one_line(e, last=True)}")
        _fail(_one_line(e) + _flag_hint(str(e)))
    except (KeyError, AttributeError) as e:  # an override of a field the recipe does not have
        _unknown_field(e, argv)
    except Exception as e:  # a recipe that fails to load or a bad override value
        # ml_collections puts the reason a recipe failed to load (e.g. no such file) last.
        _fail(f"cannot load the config: {_one_line(e, last='Failed loading' in str(e))}")


def _unknown_field(e: Exception, argv: list[str]) -> NoReturn:
    found = cli_help.field_error(e)
    name, _, hint = found.partition(" ")
    # ml_collections names the last part only: the full path, as given, is nicer
    paths = [a[len("--config.") :].split("=")[0] for a in argv if a.startswith("--config.")]
    field = next((path for path in paths if name in path.split(".")), name)
    _fail(
        f"unknown config field {field}{' ' + hint if hint else ''}; "
        "see the recipe file (or --help) for the fields it has"
    )


def _flag_hint(message: str) -> str:
    """' (did you mean --config.policy?)' for an unknown flag close to a recipe field or a flag."""
    match = re.search(r"Unknown command line flag '([^']+)'", message)
    if not match or "Did you mean" in message:  # absl found one among its own flags
        return ""
    name = match.group(1)
    try:
        fields = [f"config.{k}" for k in cli_help.recipe_config(str(DEFAULT_CONFIG))]
    except Exception:  # the hint is a courtesy: no recipe to read, no hint
        fields = []
    candidates = {f.rsplit(".", 1)[-1]: f for f in fields}
    candidates.update({f: f for f in (*fields, *flags.FLAGS)})
    found = cli_help.did_you_mean(name, candidates)
    return f" (did you mean --{candidates[found]}?)" if found else ""


def _help(argv: list[str]) -> None:
    """--help / -h: the recipe's fields and the policies, then exit 0."""
    from jamp.precision import PRESETS

    recipe = str(DEFAULT_CONFIG)
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            recipe = arg[len("--config=") :]
        elif arg == "--config" and i + 1 < len(argv):
            recipe = argv[i + 1]
    try:
        print(cli_help.help_text(recipe, recipe_names(), PRESETS))
    except Exception as e:  # a recipe that does not load: say so, as a run would
        _fail(f"cannot load the config: {_one_line(e, last=True)}")
    sys.exit(0)


def _initialize_distributed() -> None:
    """Joins a multi-process run if the flags or $JAX_COORDINATOR_ADDRESS ask for one.

    Runs before anything touches a JAX backend: `jax.distributed.initialize` has to come first.
    """
    given: dict[str, Any] = {
        "coordinator_address": _COORDINATOR.value,
        "num_processes": _NUM_PROCESSES.value,
        "process_id": _PROCESS_ID.value,
    }
    given = {name: value for name, value in given.items() if value is not None}
    if not (given or _DISTRIBUTED.value or os.environ.get("JAX_COORDINATOR_ADDRESS")):
        return
    import jax

    try:
        jax.distributed.initialize(**given)
    except Exception as e:  # bad or missing settings, or no coordinator within JAX's time-out
        _fail(f"cannot join the multi-process run: {_one_line(e)}")
    # The backends start here (the cache check asks for the process count): without the CUDA
    # plugin's log where there is no GPU, as main() starts them in a single-process run.
    _startup.start_backends()
    _keep_off_the_compilation_cache()


def _keep_off_the_compilation_cache() -> None:
    """Turns JAX's persistent compilation cache off for a multi-process CPU run where this JAX
    would hang in the collectives of a program read from it (`jax_compat`). Quietly (logged at
    INFO): a run's stderr stays what it says of the run, and a bad flag stays one line."""
    import jax

    from jamp import jax_compat

    cache = jax_compat.config_value("jax_compilation_cache_dir")
    enabled = jax_compat.config_value("jax_enable_compilation_cache")
    if not (cache and enabled and jax.process_count() > 1):
        return
    if jax.default_backend() != "cpu" or not jax_compat.cached_cpu_collectives_hang():
        return
    jax.config.update("jax_enable_compilation_cache", False)
    logging.info(
        "JAX %s hangs in the collectives of a multi-process CPU program read from its "
        "persistent compilation cache: this run compiles afresh (the cache at %s is not used)",
        jax_compat.JAX_VERSION,
        cache,
    )


def _quiet_logs() -> None:
    """What the program sets before it imports JAX, TensorFlow and the data stack."""
    # Orbax and tfds log every save and read at INFO; the progress bar and metrics say enough.
    logging.set_verbosity(logging.WARNING)
    # Advice that is noise here: tfds suggests installing OpenCV on every run that decodes images
    # (PIL is fast enough), grain on jaxlib 0.10 says its worker profiling needs jaxlib 0.11, and
    # tfds warns that a dataset about to be prepared for the first time has no info file yet.
    logging.get_absl_handler().addFilter(
        lambda r: not any(noise in r.getMessage() for noise in _LOG_NOISE)
    )
    # TensorFlow is only used to prepare datasets; its C++ start-up banners are noise here.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def main(argv: list[str], config, workdir) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; pass settings as --config.<field>=<value>")
    _quiet_logs()
    if _COMPILE_FOR.value is not None:
        _plan(config, workdir)
        return
    # Imported here so that flag errors do not pay for importing JAX and TensorFlow.
    from jamp.train import loop
    from jamp.train.checkpoint import CheckpointError
    from jamp.train.data import DataError

    try:
        resolved = config.value.to_dict() and config.value  # loads the recipe file now
    except Exception as e:  # ml_collections defers a missing or broken recipe to first use
        _fail(f"cannot load the config file: {_one_line(e, last=True)}")
    _initialize_distributed()
    _startup.start_backends()  # without the CUDA plugin's log where there is no GPU
    try:
        loop.train_and_evaluate(resolved, workdir.value)
    except (loop.ConfigError, DataError, CheckpointError) as e:
        _fail(str(e))
    except loop.TrainingDiverged as e:  # not a usage mistake: its own exit status
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_DIVERGED)


def _plan(config, workdir) -> None:
    """--compile_for: the recipe's step compiled for GPUs, reported; nothing trained."""
    from jamp.target import TargetUnavailable
    from jamp.train import plan
    from jamp.train.data import DataError
    from jamp.train.run_config import ConfigError

    try:
        resolved = config.value.to_dict() and config.value
    except Exception as e:
        _fail(f"cannot load the config file: {_one_line(e, last=True)}")
    target = _COMPILE_FOR.value
    assert target is not None  # main() plans only when --compile_for is given
    _startup.start_backends()
    try:
        with warnings.catch_warnings():  # the library's warnings (no cuDNN here) as one line
            warnings.showwarning = _warning_line
            plan.run_plan(resolved, target, workdir.value, _SEARCH_BATCH.value)
    except (ConfigError, DataError, TargetUnavailable) as e:
        _fail(str(e))


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run() -> None:
    sys.argv = _resolve_recipe_args(sys.argv)  # before ml_collections reads the recipe
    if any(arg in cli_help.HELP_FLAGS for arg in sys.argv[1:]):
        _help(sys.argv[1:])
    try:
        config, workdir = _define_flags()
    except (KeyError, AttributeError) as e:  # ml_collections' way of saying "no such field"
        _unknown_field(e, sys.argv)
    except Exception as e:
        _fail(f"cannot load the config: {_one_line(e)}")
    app.run(functools.partial(main, config=config, workdir=workdir), flags_parser=_parse_flags)
