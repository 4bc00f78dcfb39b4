"""The public surface, import cost and layering of the jamp package."""

import ast
import pathlib
import subprocess
import sys

import jamp

JAMP = pathlib.Path(jamp.__file__).parent

# What the README documents: adding a name here means documenting it there.
PUBLIC = {
    "adaptive",
    "losses",
    "lowbit",
    "rounding",
    "compile_for",
    "target",
    "module_policies",
    "FP32_MODULES",
    "PRESETS",
    "RecognitionWarning",
    "DynamicLossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "TrainState",
    "UnsupportedProgramError",
    "all_finite",
    "autocast",
    "Autocast",
    "describe_policy",
    "finite_by_group",
    "get_policy",
    "fp8",
    "hardware",
    "loss_scale_for",
    "make_eval_step",
    "make_train_step",
    "nnx",
    "parallel",
    "select_tree",
    "sharding",
    "wrap",
}

# Imports point downward only: a module may import jamp modules of a strictly lower rank.
RANK = {
    "_startup": -3,  # what import jamp does before JAX loads: beneath everything
    "jax_compat": -1,  # below mixed_ops, which calls its convolution transposes
    "precision": 0.75,  # the spec grammar and presets: above hardware ("auto")
    "policy": -1.5,  # the one policy type: beneath hardware, fp8 and all that read a policy
    "fp8": 0.5,  # above mixed_ops, whose backward dimension numbers it shares
    "mixed_ops": 0,
    "conv_patches": -0.5,  # a convolution as a matmul over its patches: beneath mixed_ops
    "grouped": 0.1,  # grouped GEMMs in a compute dtype: above mixed_ops, beneath the engine
    "copies": -1,  # the params' 16-bit copies: beneath mixed_ops and the engine, which read them
    "extension": -1.5,  # the train step's extension interface: beneath fp8 and copies
    "activations": 0,
    "hlo": 0,
    "hardware": -1,  # below precision and mixed_ops, which ask it what the device runs
    "traced_for": -2,  # below hardware, which re-exports it
    "scopes": -2,  # the NNX call scopes: names, read by fp8, nnx and inspect
    "rounding": -1,  # stochastic rounding, beneath the step and lowbit
    "lowbit": -0.5,  # low-bit optimizer state: beneath placement, which places and counts it
    "losses": 0.3,  # losses with their own backward, above mixed_ops (the fused head's matmuls)
    "grad_stats": 0.5,  # one pass over the gradients: beneath loss_scale and the step
    "finite": 0.6,  # the finite verdict: above grad_stats, beneath loss_scale and the step
    "_loss_scale_config": 0.95,  # a loss scale's settings checked: beneath loss_scale
    "loss_scale": 1,
    "engine": 0.9,  # the interpreter beneath autocast, wrap and nnx
    "attention": 0.6,  # fused attention in a compute dtype, which the engine calls
    "autocast": 1,
    "overrides": 0.8,  # above precision, whose policies override keys map to
    "nnx": 1.5,  # above autocast and overrides, below wrap, which hands NNX modules to it
    "nnx_functional": 1.4,  # an NNX model's functional side: beneath nnx, which re-exports it
    "nnx_observers": 1.4,  # who hears of wrapped NNX calls: beneath nnx, which reports to it
    "wrap": 2,
    "state": 2,
    "step": 3,
    "parallel": 4,
    "placement": 0,
    "sharding": 4,
    "models": 4,
    "checkpoint": 4,
    "stored_state": 3.8,  # the run's state against a checkpoint's: beneath checkpoint
    "stale_reads": 3.8,  # a failed Orbax restore's leftover reads silenced: beneath checkpoint
    "data": 4,
    "metrics": 4,
    "optim": 4,
    "overflow_watch": 4,
    "tasks": 5.2,  # above inspect, whose per-module output flags the loss can return
    "adaptive": 1,  # above precision and hardware: the dtype ladder
    "blame": 0.9,  # which modules a step's overflow record blames: beneath adaptive (re-exported)
    "static_placement": 0.9,  # float32 from the first step: beneath adaptive (re-exported)
    "adapting": 4.5,  # above wrap and overflow_watch, below loop
    "nnx_adapter": 4.5,  # above models, whose NNX model specs it builds
    "run_config": 5,
    "inspect": 5,  # library: see test_api_inspect_imports_no_training_program
    "target": 5.3,  # above inspect (its compiled-program report) and sharding (target meshes)
    "run_log": 5.5,
    "steps": 5.6,  # the program's placed steps: above parallel and sharding, below loop
    "fp8_sites": 5.7,  # a run's fp8 sites through restores and promotions: above steps
    "recipe_step": 5.4,  # a recipe's train step: above tasks and step, below loop and plan
    "stop": 4,  # SIGTERM / Ctrl-C as a stop request, for loop
    "loop": 6,
    "plan": 6.5,  # above loop, whose model and state builders it runs abstractly
    "cli_help": 6.9,  # the program's --help and its errors' suggestions, beneath cli
    "cli": 7,
}
# The training program's modules (jamp/train/): ranked like the library's, by their own name.
PROGRAM = {"loop", "run_config", "run_log", "checkpoint", "metrics", "optim", "tasks"}
PROGRAM |= {"overflow_watch", "data", "cli", "cli_help", "nnx_adapter", "adapting", "plan"}
PROGRAM |= {"steps", "stop", "recipe_step", "fp8_sites", "stored_state", "stale_reads"}
# Heavy or program-only dependencies, and the only modules allowed to import them.
CONFINED = {
    "tensorflow": {"data"},
    "tensorflow_datasets": {"data"},
    # stale_reads recognises Orbax's read coroutines by the directory of Orbax's own files.
    "orbax": {"checkpoint", "stale_reads"},
    "ml_collections": {"run_config", "loop", "cli"},
}


def test_api_all_is_exactly_the_documented_surface():
    assert set(jamp.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(jamp, name) is not None
    import re

    # Documented: named in the pages (README.md and docs/), and given an entry by the API reference
    # (docs/api/: an autodoc directive for each name, or a page for each submodule).
    root = JAMP.parent
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    text = "\n".join(page.read_text() for page in pages if "_build" not in page.parts)
    missing = [name for name in PUBLIC if name not in text]
    assert not missing, f"public names not documented in README.md or docs/: {missing}"
    api = "\n".join(page.read_text() for page in sorted((root / "docs" / "api").glob("*.md")))
    undocumented = [
        name for name in PUBLIC if not re.search(rf"\.\. (auto\w+|module):: jamp\.{name}\s", api)
    ]
    assert not undocumented, f"public names without an entry in docs/api/: {undocumented}"


def test_api_import_pulls_in_no_training_program_dependencies():
    code = (
        "import sys, jamp; heavy = ('tensorflow', 'tensorflow_datasets', 'orbax', "
        "'ml_collections', 'jamp.train');"
        "print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _key(parts) -> str:
    """The RANK key of a module path below jamp: jamp/train/<name> ranks by <name>."""
    if parts[0] == "train" and len(parts) > 1:
        assert parts[1] in PROGRAM, f"jamp.train.{parts[1]}: add it to PROGRAM and RANK"
        return parts[1]
    return parts[0]


def _module_key(path: pathlib.Path) -> str:
    return _key(path.relative_to(JAMP).with_suffix("").parts)


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "jamp":
                yield from (f"jamp.{alias.name}" for alias in node.names)
            else:
                yield node.module


def test_api_imports_point_downward_only():
    problems = []
    for path in sorted(JAMP.rglob("*.py")):
        if path.name == "__init__.py" and path.parent in (JAMP, JAMP / "train"):
            continue
        if path.name == "__main__.py":
            continue
        me = _module_key(path)
        assert me in RANK, f"new module {me}: give it a rank in this test"
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "jamp" and parts[1:] and parts[1:] != ["train"]:
                other = _key(parts[1:])
                if other != me and RANK[other] >= RANK[me]:
                    problems.append(f"{path.name} imports {name}")
                if parts[1] == "train" and JAMP / "train" not in path.parents:
                    problems.append(f"{path.name} (library) imports the program's {name}")
            allowed = CONFINED.get(parts[0])
            if allowed is not None and me not in allowed:
                problems.append(f"{path.name} imports {name} (only {sorted(allowed)} may)")
    assert not problems, problems


def test_api_modules_stay_small():
    # A module past this is split by concern (docs/design.md, "Habits"), not let grow.
    lines = {path: len(path.read_text().splitlines()) for path in JAMP.rglob("*.py")}
    large = {str(path.relative_to(JAMP)): n for path, n in lines.items() if n > 450}
    assert not large, large


def test_api_inspect_imports_no_training_program():
    # jamp.inspect is library (any project may use it); only its command line reads configs.
    program = {"train", "models"}
    problems = []
    for path in sorted((JAMP / "inspect").rglob("*.py")):
        if path.name == "__main__.py":
            continue
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "jamp" and len(parts) > 1 and parts[1] in program:
                problems.append(f"inspect/{path.name} imports {name}")
    assert not problems, problems


def test_api_only_parallel_calls_pmap():
    # pmap is in maintenance mode; keeping it in one module lets a sharded-jit path replace it.
    users = [
        path.name
        for path in JAMP.rglob("*.py")
        if "pmap(" in path.read_text() and path.name != "parallel.py"
    ]
    assert not users, users
