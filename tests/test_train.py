"""End-to-end tests of `python -m jamp.train`: the real CLI, in a subprocess, offline."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from subproc import cli_env, forked_cli

from jamp.train.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Recipes on tfds datasets that need a download; the offline ones (default, lm_pydoc) have own tests.
# fashion_mnist is mnist's recipe with another dataset of the same shape (tests/test_data.py
# reads both): its config is checked below without a second training run.
RECIPES = ["cifar10_cnn", "mnist", "cifar10_resnet", "lm_tiny_shakespeare"]
TRAIN_KEYS = {
    "step",
    "loss",
    "loss_scale",
    "skipped_steps",
    "grad_norm",
    "learning_rate",
    "examples_per_sec",
}

# Runs the CLI on tfds's mock data (through jamp.train.data.testing), so the tfds recipes run offline.
# sys.argv must be set before jamp.train is imported: ml_collections reads the overrides from it.
MOCKED = """
import sys
from jamp.train.data.testing import mock_tfds
sys.argv = ["jamp.train"] + sys.argv[1:]
with mock_tfds(num_examples=48):
    from jamp.train import cli as train
    train.run()
"""


def _cli(args, *, mocked=False, devices=2, timeout=600, check=True):
    if mocked:
        out = subprocess.run(
            [sys.executable, "-c", MOCKED, *args],
            cwd=ROOT,
            env=cli_env(devices),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    else:  # `python -m jamp.train`, forked from a process that has imported it
        out = forked_cli(args, devices, timeout)
    if check:
        assert out.returncode == 0, out.stderr[-4000:]
    return out


def _records(workdir: pathlib.Path, kind: str):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


def _smoke(recipe, workdir, data_dir, *extra, **kwargs):
    return _cli(
        [
            f"--config=configs/{recipe}.py:smoke",
            f"--workdir={workdir}",
            f"--config.data_dir={data_dir}",
            *extra,
        ],
        **kwargs,
    )


@pytest.mark.program
def test_train_default_recipe_smoke_writes_metrics_config_checkpoints_and_summary(
    tmp_path, data_dir
):
    workdir = tmp_path / "run"
    out = _smoke("default", workdir, data_dir)
    train = _records(workdir, "train")
    assert train and all(TRAIN_KEYS <= set(r) for r in train)
    assert [r["step"] for r in train][-1] == 12
    evals = _records(workdir, "eval")
    assert evals and 0.0 <= evals[-1]["accuracy"] <= 1.0
    config = json.loads((workdir / "config.json").read_text())
    assert config["policy"] == "mixed_float16" and config["dataset"] == "digits"
    assert list(workdir.glob("events.out.tfevents*"))
    assert (workdir / "checkpoints").is_dir()
    for row in ("policy", "skipped steps", "final loss scale", "eval accuracy", "throughput"):
        assert row in out.stdout


@pytest.mark.program
def test_train_lm_pydoc_recipe_smoke_runs_offline_on_real_text(tmp_path, data_dir):
    # Offline like the default recipe: the text ships with Python, so no mock data is needed.
    workdir = tmp_path / "lm_pydoc"
    out = _smoke("lm_pydoc", workdir, data_dir)
    assert _records(workdir, "train")[-1]["step"] == 12
    evals = _records(workdir, "eval")
    assert evals and evals[-1]["perplexity"] < 256  # below uniform over bytes: it learned
    config = json.loads((workdir / "config.json").read_text())
    assert config["dataset"] == "pydoc" and config["policy"] == "mixed_bfloat16"
    assert "eval perplexity" in out.stdout


@pytest.mark.program
@pytest.mark.parametrize("recipe", RECIPES)
def test_train_smoke_of_every_recipe_runs_on_mock_tfds_data(recipe, tmp_path):
    workdir = tmp_path / recipe
    _smoke(recipe, workdir, tmp_path / "tfds", mocked=True)
    assert _records(workdir, "train")[-1]["step"] == 12
    metric = "perplexity" if recipe.startswith("lm") else "accuracy"
    assert metric in _records(workdir, "eval")[-1]


def test_train_fashion_mnist_recipe_is_the_mnist_one_on_its_dataset():
    import runpy

    from jamp.train import loop

    def parsed(recipe):
        config = runpy.run_path(str(ROOT / "configs" / f"{recipe}.py"))["get_config"]("smoke")
        return loop.parse_config(config)

    (run, data_cfg, _, task), (mnist_run, mnist_data, _, _) = (
        parsed("fashion_mnist"),
        parsed("mnist"),
    )
    assert data_cfg.dataset == "fashion_mnist" and mnist_data.dataset == "mnist"
    assert (run.model, run.policy, task) == (mnist_run.model, mnist_run.policy, "classification")


@pytest.mark.program
def test_train_synthetic_recipe_and_policy_flag(tmp_path):
    workdir = tmp_path / "synthetic"
    _cli(
        [
            "--config=configs/synthetic.py:smoke",
            f"--workdir={workdir}",
            "--config.policy=mixed_bfloat16",
        ]
    )
    assert _records(workdir, "train")[-1]["loss_scale"] == 1.0  # bf16: no loss scaling


@pytest.mark.program
def test_train_profile_steps_writes_the_profile_and_trains_as_without(tmp_path, data_dir):
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    _smoke("default", plain, data_dir)
    out = _smoke("default", profiled, data_dir, "--config.profile_steps=3")
    for name in ("profile.txt", "profile.png", "profile.json"):
        assert (profiled / name).stat().st_size > 0, name
    assert "shares add up to" in out.stdout and "convolution" in out.stdout
    data = json.loads((profiled / "profile.json").read_text())
    modules = {row["module"] for row in data["rows"]}
    assert {"Conv_0", "Conv_1", "Dense_0", "Dense_1"} <= modules
    assert 0.0 < data["attributed_fraction"] <= 1.02
    # The profiled steps (one warm-up + 3) are training steps like any other.
    last = [_records(w, "train")[-1] for w in (plain, profiled)]
    assert last[0]["step"] == last[1]["step"] == 12 and last[0]["loss"] == last[1]["loss"]
    assert _records(plain, "eval")[-1] == _records(profiled, "eval")[-1]


@pytest.mark.program
def test_train_says_what_auto_picked_and_warns_when_16_bit_is_emulated(tmp_path, data_dir):
    from jamp import get_policy, hardware
    from jamp.precision import auto_reason

    # What this machine does decides the lines; the program must print exactly these.
    expected = hardware.emulation_warning(get_policy("mixed_float16"))
    out = _smoke("default", tmp_path / "f16", data_dir, "--config.policy=mixed_float16")
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ([expected] if expected else [])
    if expected:  # it names the faster choice, once: the summary says "emulated" instead
        assert "faster choice" in expected and expected.removeprefix("warning: ") not in out.stdout
        assert "emulated on" in out.stdout
    assert "hardware " in out.stdout and "matmuls" in out.stdout
    auto = _smoke("default", tmp_path / "auto", data_dir, "--config.policy=auto")
    picked = auto_reason("auto")
    assert picked.startswith("auto picked ") and picked in auto.stdout
    policy = "compute=bfloat16" if "mixed_bfloat16" in picked.split(":")[0] else "float32"
    assert policy in [line for line in auto.stdout.splitlines() if line.startswith("policy")][0]


@pytest.mark.program
def test_train_resumes_where_it_stopped(tmp_path, data_dir):
    workdir = tmp_path / "resume"
    _smoke("default", workdir, data_dir, "--config.num_train_steps=6")
    _smoke("default", workdir, data_dir)  # the same run, now to 12 steps
    steps = [r["step"] for r in _records(workdir, "train")]
    assert steps == sorted(steps) and steps[-1] == 12
    assert steps.count(4) == 1  # steps 1-6 were not trained again
    # Run once more, finished: one line saying so and how to go on, nothing trained or written.
    metrics = (workdir / "metrics.jsonl").read_text()
    out = _smoke("default", workdir, data_dir)
    assert f"the run in {workdir} is complete: its checkpoint is at step 12" in out.stdout
    assert "--config.num_train_steps" in out.stdout and "another --workdir" in out.stdout
    assert "resuming" not in out.stdout and "throughput" not in out.stdout
    assert (workdir / "metrics.jsonl").read_text() == metrics


@pytest.mark.program
def test_train_hooks_run_on_the_first_step_too(tmp_path, data_dir):
    # The first step compiles and is left out of the throughput, but a checkpoint or an
    # evaluation due at it is not skipped.
    workdir = tmp_path / "every"
    every = [f"--config.{hook}_every_steps=1" for hook in ("checkpoint", "eval", "log")]
    _smoke("default", workdir, data_dir, "--config.num_train_steps=3", *every)
    with Checkpointer(workdir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
    assert [r["step"] for r in _records(workdir, "eval")] == [1, 2, 3]
    assert [r["step"] for r in _records(workdir, "train")] == [2, 3]


@pytest.mark.program
def test_train_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, data_dir):
    workdir = tmp_path / "sigterm"
    cmd = [
        sys.executable,
        "-m",
        "jamp.train",
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        "--config.num_train_steps=100000",
        "--config.log_every_steps=5",
        "--config.checkpoint_every_steps=100000",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 300
        while not (workdir / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.5)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout
    assert "Traceback" not in stderr
    steps = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps and max(steps) < 100000


ERRORS = [
    (["--config.policy=mixed_float12"], "mixed_float12"),
    (["--config.dataset=imagenet_9000"], "imagenet_9000"),
    (["--config.model=vgg99"], "vgg99"),
    (["--config.no_such_field=1"], "no_such_field"),
    (["--config.batch_size=10"], "batch_size"),
    (["--config.loss_scale=sometimes"], "sometimes"),
    (["--config.learning_rate=-1"], "learning_rate"),
    (["--config=configs/no_such_recipe.py"], "no_such_recipe"),
    (["--config.profile_steps=-1"], "profile_steps"),
    (["--config.profile_steps=1000"], "profile_steps"),
    (["--config.fp8_recipe=late"], "fp8_recipe 'late' is not one of current, delayed"),
    (["--config.fp8_history=0"], "fp8_history"),
    (["--config.policy=p=f32,c=f16,o=f32,matmul=f8"], "matmul=f8 needs compute=bf16"),
]


@pytest.mark.program
@pytest.mark.parametrize("args,needle", ERRORS, ids=[e[1] for e in ERRORS])
def test_train_bad_input_is_one_line_and_nonzero_exit(args, needle, tmp_path, data_dir, forked_cli):
    workdir = tmp_path / "w"
    out = forked_cli([*args, f"--workdir={workdir}", f"--config.data_dir={data_dir}"], 8)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-3000:]
    assert needle in lines[0] and "Traceback" not in out.stderr
    assert not workdir.exists() or not any(workdir.iterdir())


@pytest.mark.program
def test_train_bad_matmul_lowering_variable_is_one_line(tmp_path, data_dir):
    env = {**cli_env(1), "JAMP_MATMUL_LOWERING": "fast"}
    out = subprocess.run(
        [sys.executable, "-m", "jamp.train", f"--workdir={tmp_path / 'w'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "JAMP_MATMUL_LOWERING" in lines[0]
    assert not (tmp_path / "w").exists()


@pytest.mark.program
def test_train_unwritable_workdir_is_one_line(tmp_path, data_dir, forked_cli):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = forked_cli([f"--workdir={blocker / 'run'}", f"--config.data_dir={data_dir}"])
    assert out.returncode != 0 and "not writable" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert blocker.read_text() == "not a directory"


@pytest.mark.program
def test_train_checkpoint_of_another_model_is_refused_and_kept(tmp_path, data_dir):
    workdir = tmp_path / "other"
    _smoke("default", workdir, data_dir, "--config.num_train_steps=6")
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    out = _smoke("default", workdir, data_dir, "--config.model=resnet20", check=False)
    assert out.returncode != 0
    assert len(out.stderr.strip().splitlines()) == 1 and "checkpoint" in out.stderr
    after = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    assert after == before
