"""Malformed input to `python -m jamp.train`, one table row each, through the real CLI.

Every row must end the program with exactly one non-empty line on stderr that names the problem,
a non-zero exit status, no traceback, and every file under the workdir exactly as it was.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from subproc import cli_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.program
SMOKE = "--config=configs/default.py:smoke"

# One malformed input a row: id | arguments | what the one line on stderr must contain.
# "field=value" stands for --config.field=value, "LS." for "loss_scale_params." and "{file}" for
# the path of a regular file.
TABLE = """
# policies and dtype names
policy_preset   | policy=mixed_float12                    | policy 'mixed_float12': Unknown dtype
policy_f64      | policy=p=f32,c=f64                      | 'p=f32,c=f64': Unknown dtype 'f64'
policy_gap      | policy=p=f32,,c=bf16                    | entry '' is not of the form key=dtype
policy_empty    | policy=                                 | policy '': empty string
policy_twice    | policy=c=bf16,c=f16                     | duplicate key 'c' (compute given twice)
policy_int8     | policy=compute=int8                     | Unknown dtype 'int8'
policy_dtype    | policy=bfloat17                         | Unknown dtype 'bfloat17'
activations     | activations=fast                        | activations='fast' is not one of 'a
# loss scales
scale_kind      | loss_scale=sometimes                    | unknown loss_scale 'sometimes'
initial_neg     | LS.initial=-1                           | initial must be finite and > 0, got -1.0
initial_zero    | LS.initial=0                            | initial must be finite and > 0, got 0.0
initial_nan     | LS.initial=nan                          | initial must be finite and > 0, got nan
initial_inf     | LS.initial=inf                          | initial must be finite and > 0, got inf
static_nan      | loss_scale=static LS.initial=nan        | initial must be finite and > 0, got nan
initial_huge    | LS.initial=1e30                         | initial must be between min_scale 1.0
growth_factor   | LS.growth_factor=1.0                    | growth_factor must be > 1, got 1.0
backoff_one     | LS.backoff_factor=1.0                   | backoff_factor must be in (0, 1), got 1
backoff_zero    | LS.backoff_factor=0.0                   | backoff_factor must be in (0, 1), got 0
hysteresis      | LS.hysteresis=0                         | hysteresis must be an int >= 1 (or a w
min_above_max   | LS.min_scale=1024 LS.max_scale=2        | need 0 < min_scale <= max_scale < inf
growth_interval | LS.growth_interval=0                    | growth_interval must be an int >= 1
# config keys
unknown_field   | no_such_field=1                         | unknown config field no_such_field;
unknown_nested  | LS.no_such=1                            | field loss_scale_params.no_such;
unknown_arg     | model_config.widht=3                    | unknown config field model_config.widht;
misspelled      | polcy=mixed_bfloat16                    | unknown config field polcy (did you mean policy?);
misspelled_flag | --polciy=mixed_bfloat16                 | flag 'polciy' (did you mean --config.policy?)
# config values
batch_type      | batch_size=abc                          | --config.batch_size=abc: invalid literal
steps_negative  | num_train_steps=-5                      | num_train_steps must be a positive int
log_every_zero  | log_every_steps=0                       | log_every_steps must be a positive int
ckpt_every_zero | checkpoint_every_steps=0                | checkpoint_every_steps must be a posit
lr_negative     | learning_rate=-1                        | learning_rate must be finite and > 0
lr_nan          | learning_rate=nan                       | learning_rate must be finite and > 0
lr_inf          | learning_rate=inf                       | learning_rate must be finite and > 0
optimizer       | optimizer=adamax                        | unknown optimizer 'adamax'; accepted:
schedule        | schedule=linear                         | unknown schedule 'linear'; accepted:
warmup          | schedule=warmup_cosine warmup_steps=100 | warmup_steps must be between 0 and
clip_negative   | max_grad_norm=-1                        | max_grad_norm must be >= 0 (0: no clip
clip_nan        | max_grad_norm=nan                       | max_grad_norm must be >= 0 (0: no clip
decay_negative  | weight_decay=-0.1                       | weight_decay must be finite and >= 0
decay_nan       | weight_decay=nan                        | weight_decay must be finite and >= 0
momentum        | momentum=1.5                            | momentum must be in [0, 1), got 1.5
opt_state       | optimizer_state=int4                    | unknown optimizer_state 'int4'; acce
rounding        | param_rounding=up                       | unknown param_rounding 'up'; accepted
sr_float16      | policy=float16 param_rounding=stochastic | stores params in float16, which th
f16_params      | policy=f16                              | did you mean 'mixed_float16' (float
policy_fp16     | policy=fp16                             | Did you mean 'mixed_float16'?
policy_fp8      | policy=fp8                              | Did you mean 'mixed_fp8'?
kahan_float32   | param_rounding=kahan                    | param_rounding=kahan compensates the
seed_type       | seed=1.5                                | --config.seed=1.5: invalid literal
# batch sizes over the 8 devices every case runs with
accumulation    | accumulation_steps=3                    | accumulation_steps 3 does not divide
batch_devices   | batch_size=12                           | batch_size 12 does not divide evenly
parallelism     | parallelism=pjit                        | unknown parallelism 'pjit'; accepted:
mesh_too_big    | parallelism=sharded mesh=data=3,fsdp=4  | mesh: mesh 'data=3,fsdp=4' needs 12
mesh_axis       | parallelism=sharded mesh=pipe=8         | mesh: unknown mesh axis 'pipe'; axes
# paths
recipe_missing  | --config=configs/nope.py                | No such file or directory: 'configs/nope
recipe_dir      | --config=configs                        | Is a directory: 'configs'
recipe_variant  | --config=configs/default.py:huge        | unknown config variant 'huge'
recipe_typo     | --config=defualt:smoke                  | unknown recipe 'defualt' (did you mean 'default'?)
data_dir_file   | data_dir={file}                         | cannot be used: {file} is not a dir
data_dir_below  | data_dir={file}/tfds                    | /tfds cannot be used: {file} is not
# datasets and models
dataset         | dataset=imagenet_9000                   | unknown dataset 'imagenet_9000'
model           | model=vgg99                             | unknown model 'vgg99'; accepted:
task_mismatch   | model=transformer_lm                    | on lm data but dataset 'digits' is
# the command line
positional      | extra_argument                          | unexpected arguments ['extra_argument']
"""


def _cases():
    for row in TABLE.strip().splitlines():
        if row.startswith("#"):
            continue
        case_id, args, needle = (part.strip() for part in row.split(" | "))
        args = args.replace("LS.", "loss_scale_params.").split()
        args = [a if a.startswith("--") or "=" not in a else f"--config.{a}" for a in args]
        yield pytest.param(args, needle, id=case_id)


def _cli(args, devices=8) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jamp.train", *args],
        cwd=ROOT,
        env=cli_env(devices),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _snapshot(root: pathlib.Path) -> dict[str, bytes | None]:
    """Every path under `root` (and `root` itself), with the bytes of each file."""
    if not root.exists():
        return {}
    paths = [root, *root.rglob("*")]
    return {str(p): (p.read_bytes() if p.is_file() else None) for p in paths}


def _assert_one_line_error(out: subprocess.CompletedProcess, needle: str) -> str:
    assert out.returncode != 0, out.stdout[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-4000:]
    assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_recipes_fields_policy_first_and_exits_0(flag):
    out = _cli([flag, "--config=lm_pydoc"])
    assert out.returncode == 0, out.stderr[-2000:]
    fields = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  --config.")]
    assert fields[0] == "--config.policy" and "--config.seq_len" in fields
    assert "mixed_bfloat16" in out.stdout and "Example:" in out.stdout
    assert "lm_pydoc" in out.stdout  # the recipes


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from jamp.train.data import prepare_digits

    path = tmp_path_factory.mktemp("tfds")
    prepare_digits(str(path))
    return path


@pytest.fixture
def workdir(tmp_path):
    """An existing workdir with a file in it, which a failed run must leave alone."""
    path = tmp_path / "run"
    path.mkdir()
    (path / "notes.txt").write_text("kept as it is\n")
    return path


@pytest.mark.parametrize("args, needle", list(_cases()))
def test_bad_input_is_one_line_nonzero_and_changes_nothing(
    args, needle, workdir, data_dir, tmp_path, forked_cli
):
    a_file = tmp_path / "a_file"
    a_file.write_text("a regular file\n")
    args = [arg.replace("{file}", str(a_file)) for arg in args]
    needle = needle.replace("{file}", str(a_file))
    recipe = [arg for arg in args if arg.startswith("--config=")] or [SMOKE]
    rest = [arg for arg in args if not arg.startswith("--config=")]
    before = _snapshot(tmp_path)
    out = forked_cli([*recipe, f"--workdir={workdir}", f"--config.data_dir={data_dir}", *rest], 8)
    _assert_one_line_error(out, needle)
    assert _snapshot(tmp_path) == before


def test_bad_input_workdir_under_a_regular_file(tmp_path, data_dir, forked_cli):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    before = _snapshot(tmp_path)
    out = forked_cli([SMOKE, f"--workdir={blocker / 'run'}", f"--config.data_dir={data_dir}"], 8)
    _assert_one_line_error(out, "not a directory")
    assert _snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory, data_dir):
    """A workdir holding the checkpoints of a short run of the seed CNN."""
    path = tmp_path_factory.mktemp("trained") / "run"
    out = _cli(
        [SMOKE, f"--workdir={path}", f"--config.data_dir={data_dir}", "--config.num_train_steps=1"]
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return path


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--config.model=resnet20"], "does not match this model"),
        (["--config.dataset=synthetic_images"], "does not match this model"),
        (
            ["--config.policy=mixed_bfloat16,params=bf16"],
            "dtype float32 in the checkpoint and bfloat16 here",
        ),
        (["--config.loss_scale=none"], "does not match this model"),
    ],
    ids=["other_model", "other_image_size", "other_param_dtype", "other_loss_scale"],
)
def test_bad_input_checkpoint_of_another_config_is_refused(
    args, needle, trained_workdir, data_dir, forked_cli
):
    before = _snapshot(trained_workdir)
    out = forked_cli(
        [SMOKE, f"--workdir={trained_workdir}", f"--config.data_dir={data_dir}", *args], 8
    )
    line = _assert_one_line_error(out, needle)
    assert "checkpoint" in line
    assert _snapshot(trained_workdir) == before
