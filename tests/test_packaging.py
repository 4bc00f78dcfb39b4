"""jamp as it would be uploaded (sdist, wheel, their metadata) and installed as users install it
(a wheel, not the checkout): the program and its recipes from an empty directory."""

from __future__ import annotations

import email.parser
import pathlib
import site
import subprocess
import sys
import venv
import zipfile

import pytest
from subproc import cli_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.program


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist and the wheel, as an upload would carry them: `python -m build` makes the sdist
    from the checkout and the wheel from the sdist (so a file the sdist misses fails here), with
    the test environment's setuptools (--no-isolation: nothing is downloaded)."""
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "-o", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        cwd=out,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (sdist,) = out.glob("jamp_jax-*.tar.gz")
    (wheel,) = out.glob("jamp_jax-*-py3-none-any.whl")
    return sdist, wheel


def test_packaging_sdist_and_wheel_pass_the_index_metadata_check(dist):
    sdist, wheel = dist
    check = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("PASSED") == 2
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(z.read(metadata).decode())
    # The distribution's name is ours; the import name, the program and the typing marker stay.
    assert meta["Name"] == "jamp-jax" and meta["License-Expression"] == "Apache-2.0"
    assert "jamp/py.typed" in names and "jamp/train/__main__.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert {"train", "train-tf", "gpu-compile", "docs"} <= set(meta.get_all("Provides-Extra"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory, dist):
    """A venv with jamp installed from the wheel of this checkout; the rest (jax, tfds, ...) is
    the test environment's, put on the new venv's path after its own site-packages, so nothing is
    downloaded (and the checkout's editable install, a .pth hook there, is not active)."""
    tmp = tmp_path_factory.mktemp("install")
    wheel = dist[1]
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
