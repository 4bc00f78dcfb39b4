"""jamp installed as users install it (a wheel, not the checkout): the program and its recipes."""

from __future__ import annotations

import pathlib
import site
import subprocess
import sys
import venv

import pytest
from subproc import cli_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.program


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv with jamp installed from a wheel of this checkout; the rest (jax, tfds, ...) is the
    test environment's, put on the new venv's path after its own site-packages, so nothing is
    downloaded (and the checkout's editable install, a .pth hook there, is not active)."""
    tmp = tmp_path_factory.mktemp("install")
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    (wheel,) = wheels.glob("jamp_jax-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (pathlib.Path(own) / "test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q"]
        + [str(wheel)],
        check=True,
        capture_output=True,
        cwd=tmp,
    )
    return python


def _run(python, args, cwd, timeout=600):
    env = cli_env(2)
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_packaging_wheel_carries_the_package_and_every_recipe(installed, tmp_path):
    out = _run(
        installed,
        [
            "-c",
            "import jamp, jamp.train.cli as t; print(jamp.__file__); print(*t.recipe_names()); "
            "print(*t._resolve_recipe_args(['--config', 'synthetic:smoke']))",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    where, names, spaced = out.stdout.splitlines()
    assert str(installed.parent.parent) in where  # the installed copy, not the checkout
    assert names.split() == sorted(p.stem for p in (ROOT / "configs").glob("[!_]*.py"))
    # `--config NAME` (two arguments) names the recipe the install carries, as `--config=NAME`
    # does (which the runs below take through the whole program)
    flag, recipe = spaced.split()
    assert flag == "--config" and recipe.endswith("jamp/configs/synthetic.py:smoke")
    assert str(installed.parent.parent) in recipe


@pytest.mark.parametrize(
    "config",
    [
        [],  # the default recipe (a few steps of it)
        ["--config=synthetic:smoke"],
        ["--config=configs/default.py:smoke"],  # the README's form, outside a checkout
    ],
    ids=["default", "name", "configs_path"],
)
def test_packaging_train_runs_recipes_from_an_empty_directory(installed, tmp_path, config):
    cwd = tmp_path / "empty"
    cwd.mkdir()
    args = ["-m", "jamp.train", *config, f"--config.data_dir={tmp_path / 'tfds'}"]
    if not config:
        args += ["--config.num_train_steps=4", "--config.eval_every_steps=4"]
    out = _run(installed, args + [f"--workdir={tmp_path / 'run'}"], cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert not any(cwd.iterdir())  # nothing written where the program was started


def test_packaging_unknown_recipe_name_is_one_line_listing_the_recipes(installed, tmp_path):
    out = _run(installed, ["-m", "jamp.train", "--config=cifar11"], tmp_path)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "unknown recipe 'cifar11'" in line and "cifar10_resnet" in line
