"""Adaptive precision and static placement in `python -m jamp.train`.

The model is the seed CNN with a pre-norm projection whose activations are 1e5 times larger
than the layer norm after it passes on (`hidden_gain`, a stand-in for the "massive activations"
of large LMs). Its activations carried in float16 (`activations=compute`, the GPU default)
overflow there, in that one module, on every step: fp16 alone ends in the persistent-overflow
stop; adaptive precision moves that module, and only it, to bfloat16 (float32 on a CPU without
native bf16 matmuls). The same tests run on the linen model (`Dense_0`, the default recipe) and
on the NNX one (`dense1`, the digits_nnx recipe).
"""

from __future__ import annotations

import json
import pathlib
import runpy
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subproc import cli_env, forked_cli, recipe_state

from jamp import hardware
from jamp.fp8 import formats as fp8_formats
from jamp.train.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
FRAGILE = {
    "model_config": "{'hidden_gain': 1e5}",
    "activations": "compute",
    "log_every_steps": 25,
    "eval_every_steps": 1000,
}
# The first rung above float16 on this machine (the subprocesses see the same CPU).
UP = "bfloat16" if hardware.support(jnp.bfloat16).native else "float32"
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# flavor -> (recipe, the fragile module's path)
FLAVORS = {"linen": ("default", "Dense_0"), "nnx": ("digits_nnx", "dense1")}


@pytest.fixture(scope="module", params=list(FLAVORS))
def flavor(request):
    return request.param


def _command(workdir, data_dir, flavor="linen", **overrides):
    flags = {**FRAGILE, "data_dir": data_dir, **overrides}
    return [
        sys.executable,
        "-m",
        "jamp.train",
        f"--config=configs/{FLAVORS[flavor][0]}.py",
        f"--workdir={workdir}",
        *(f"--config.{k}={v}" for k, v in flags.items()),
    ]


def _cli(workdir, data_dir, devices=2, flavor="linen", **overrides):
    return forked_cli(_command(workdir, data_dir, flavor, **overrides)[3:], devices)


def _records(workdir, kind):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _summary(stdout, row):
    found = [line for line in stdout.splitlines() if line.startswith(row)]
    assert found, stdout
    return found[-1][len(row) :].strip()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # Prepared here, so that no test's stderr depends on whether it was the first to need it.
    from jamp.train.data import prepare_digits

    path = tmp_path_factory.mktemp("tfds")
    prepare_digits(str(path))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, flavor):
    """The fragile model for 300 steps on one device: adaptive fp16, and float32."""
    out = {}
    for name, flags in (
        ("adaptive", {"adaptive_precision": "true"}),
        ("float32", {"policy": "float32"}),
    ):
        workdir = tmp_path_factory.mktemp(name) / "run"
        result = _cli(workdir, data_dir, 1, flavor, num_train_steps=300, **flags)
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = (workdir, result)
    return out


@pytest.mark.program
def test_fp16_without_adaptation_ends_in_the_persistent_overflow_stop(tmp_path, data_dir, flavor):
    out = _cli(tmp_path / "run", data_dir, flavor=flavor, num_train_steps=150)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "training stopped at step" in out.stderr and "cannot back off" in out.stderr


@pytest.mark.program
def test_adaptive_promotes_the_fragile_module_alone_within_n_steps(runs, flavor):
    workdir, out = runs["adaptive"]
    fragile = FLAVORS[flavor][1]
    changes = _records(workdir, "precision_change")
    assert [(c["module"], c["from_dtype"], c["to_dtype"]) for c in changes] == [
        (fragile, "float16", UP)
    ]
    assert changes[0]["step"] <= 50  # n, the window
    assert f"{fragile} now computes in {UP} (was float16)" in out.stderr
    assert _summary(out.stdout, "precision changes").startswith(f"{fragile}: float16 -> {UP} at")
    # after the promotion nothing is skipped: the scale grows back to where it started
    train = _records(workdir, "train")
    assert train[-1]["skipped_steps"] == changes[0]["step"]
    assert train[-1]["loss_scale"] == 2.0**16


@pytest.mark.program
def test_adaptive_fp16_ends_within_half_a_point_of_float32(runs):
    got = float(_summary(runs["adaptive"][1].stdout, "eval accuracy"))
    want = float(_summary(runs["float32"][1].stdout, "eval accuracy"))
    assert got >= want - 0.005, (got, want)


def _steps(workdir):
    directory = workdir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _final(workdir, data_dir, flags, flavor):
    overrides = {k: v for k, v in flags.items() if k not in ("adaptive_precision", "adaptive.k")}
    overrides.update(adaptive_precision=True, model_config={"hidden_gain": 1e5})
    overrides.update(activations="compute", **{"adaptive.k": int(flags["adaptive.k"])})
    target = recipe_state(data_dir, overrides, FLAVORS[flavor][0])
    with Checkpointer(workdir / "checkpoints") as ckpt:
        return ckpt.restore(target, step=30)


def _assert_bit_identical(got, want):
    paths = jax.tree_util.tree_flatten_with_path(want)[0]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, x), y in zip(paths, jax.tree.leaves(got)):
        np.testing.assert_array_equal(
            np.asarray(y), np.asarray(x), err_msg=jax.tree_util.keystr(path), strict=True
        )


@pytest.mark.program
def test_promotion_survives_sigkill_and_resume_bit_exactly(tmp_path, data_dir, flavor):
    # k = 15: the module is blamed on steps 1-15 and promoted at step 15, after the checkpoint at
    # step 10. A run stopped at 10 and resumed must decide at 15 from the restored window; a run
    # killed after the checkpoint at 20 must keep the promotion. Both end bit-identical.
    flags = {"adaptive_precision": "true", "adaptive.k": 15, "num_train_steps": 30}
    flags.update(checkpoint_every_steps=10, log_every_steps=10, max_checkpoints_to_keep=5)
    reference = tmp_path / "reference"
    out = _cli(reference, data_dir, flavor=flavor, **flags)
    assert out.returncode == 0, out.stderr[-3000:]
    (change,) = _records(reference, "precision_change")
    assert change["step"] == 15
    want = _final(reference, data_dir, flags, flavor)
    assert int(np.asarray(want.adaptive_state.rung).sum()) == 1

    resumed = tmp_path / "resumed"  # stops at 10, before the decision
    out = _cli(resumed, data_dir, flavor=flavor, **{**flags, "num_train_steps": 10})
    assert out.returncode == 0 and not _records(resumed, "precision_change"), out.stderr[-3000:]
    out = _cli(resumed, data_dir, flavor=flavor, **flags)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from the checkpoint at step 10" in out.stdout
    assert [c["step"] for c in _records(resumed, "precision_change")] == [15]
    _assert_bit_identical(_final(resumed, data_dir, flags, flavor), want)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(killed, data_dir, flavor, **flags),
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (killed / "checkpoints" / "20").exists() and proc.poll() is None:
            assert time.time() < deadline
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL and _steps(killed)[-1] < 30
    out = _cli(killed, data_dir, flavor=flavor, **flags)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from the checkpoint" in out.stdout
    # the summary after the resume still lists the promotion made before the kill
    assert f"{FLAVORS[flavor][1]}: float16 -> {UP} at step 15" in out.stdout
    _assert_bit_identical(_final(killed, data_dir, flags, flavor), want)


@pytest.mark.program
def test_adaptive_precision_can_be_switched_on_to_resume_a_run(tmp_path, data_dir):
    workdir = tmp_path / "run"
    out = _cli(workdir, data_dir, num_train_steps=10, checkpoint_every_steps=10,
               model_config="{}")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    out = _cli(workdir, data_dir, num_train_steps=20, checkpoint_every_steps=10,
               model_config="{}", adaptive_precision="true")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from the checkpoint at step 10" in out.stdout
    # and off again: the checkpoint now holds promotions state, refused in one line
    out = _cli(workdir, data_dir, num_train_steps=30, checkpoint_every_steps=10,
               model_config="{}")  # fmt: skip
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode != 0 and "--config.adaptive_precision=true" in lines[-1], out.stderr


@pytest.mark.program
def test_every_replica_and_the_sharded_step_promote_at_the_same_step(
    runs, tmp_path, data_dir, flavor
):
    # The same first 12 steps as the one-device run of `runs`, over 8 replicas and sharded.
    changes = _records(runs["adaptive"][0], "precision_change")
    steps = {"one": [(c["step"], c["module"]) for c in changes if c["step"] <= 12]}
    for name, flags in (
        ("pmap8", {}),
        ("sharded", {"parallelism": "sharded", "mesh": "data=2,fsdp=4"}),
    ):
        workdir = tmp_path / name
        out = _cli(
            workdir, data_dir, 8, flavor, adaptive_precision="true", num_train_steps=12, **flags
        )
        assert out.returncode == 0, out.stderr[-3000:]
        steps[name] = [(c["step"], c["module"]) for c in _records(workdir, "precision_change")]
    assert steps["one"] and steps["one"] == steps["pmap8"] == steps["sharded"], steps


def test_keep_in_float32_places_modules_statically(data_dir):
    import runpy

    from jamp.models import model_task
    from jamp.train import loop
    from jamp.wrap import module_policies

    config = runpy.run_path(str(ROOT / "configs" / "default.py"))["get_config"]()
    config.data_dir = str(data_dir)
    config.keep_in_float32 = "first:1,Dense_1"
    run, data_cfg, _, _ = loop.parse_config(config)
    dataset, model = loop.build_model(run, data_cfg, model_task(run.model))
    x = jnp.zeros((1, *dataset.info.input_shape))
    variables = model.init(jax.random.key(0), x)
    got = {
        p: np.dtype(q.compute_dtype).name for p, q in module_policies(model, variables, x).items()
    }
    assert got["Conv_0"] == got["Dense_1"] == "float32"
    assert got["Conv_1"] == got["Dense_0"] == "float16"


ON = "--config.adaptive_precision=true"


@pytest.mark.program
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--config.keep_in_float32=last:9"], ["keep_in_float32", "from 1 to 4"]),
        (["--config.keep_in_float32=middle:1"], ["first:N / last:N"]),
        (["--config.adaptive_precision=maybe"], ["adaptive_precision"]),
        (["--config.adaptive.k=80"], ["1 <= k <= n"]),
        # Settings that would silently do nothing (or undo themselves) are errors too.
        (["--config.keep_in_float32=Dense_9"], ["'Dense_9' matches no module", "Dense_0"]),
        (
            ["--config.model=seed_cnn_nnx", "--config.keep_in_float32=conv1,conv9"],
            ["'conv9' matches no module", "conv1, conv2"],
        ),
        ([ON, "--config.adaptive.demote_after=6"], ["demote_after", "greater than adaptive.k"]),
        ([ON, "--config.persistent_overflow_steps=5"], ["persistent_overflow_steps=5", "k=6"]),
    ],
)
def test_bad_adaptive_flags_get_one_line(tmp_path, data_dir, flags, words, forked_cli):
    out = forked_cli(
        [
            "--config=configs/default.py:smoke",
            f"--workdir={tmp_path / 'run'}",
            f"--config.data_dir={data_dir}",
            *flags,
        ]
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "run").exists()


def test_keep_in_float32_places_nnx_modules_by_attribute_path(data_dir):
    from jamp.models import model_task
    from jamp.train import loop

    config = runpy.run_path(str(ROOT / "configs" / "digits_nnx.py"))["get_config"]()
    config.data_dir = str(data_dir)
    config.keep_in_float32 = "first:1"  # no family of blocks: the first top-level module
    run, data_cfg, _, _ = loop.parse_config(config)
    dataset, model = loop.build_model(run, data_cfg, model_task(run.model))
    x = jnp.zeros((1, *dataset.info.input_shape))
    variables = model.init(jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x, train=False))(variables)
    convs = [
        e.invars[0].aval.dtype.name
        for e in _eqns(jaxpr.jaxpr)
        if e.primitive.name == "conv_general_dilated"
    ]
    assert convs == ["float32", "float16"], convs  # conv1 kept, conv2 under the policy


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield from _eqns(inner)
            elif hasattr(value, "eqns"):
                yield from _eqns(value)


@pytest.mark.program
def test_the_persistent_overflow_stop_says_when_promotions_have_run_out(tmp_path, data_dir):
    # hidden_gain 1e39 overflows even float32: Dense_0 climbs float16 -> bfloat16 -> float32 and
    # the run still cannot take a step; the stop then blames the model, not the format.
    out = _cli(
        tmp_path / "run",
        data_dir,
        model_config="{'hidden_gain': 1e39}",
        adaptive_precision="true",
        num_train_steps=200,
        log_every_steps=10,
        persistent_overflow_steps=20,
    )
    assert out.returncode == 3, out.stderr[-2000:]
    changes = _records(tmp_path / "run", "precision_change")
    assert [(c["module"], c["to_dtype"]) for c in changes] == [
        ("Dense_0", UP),
        *([("Dense_0", "float32")] if UP != "float32" else []),
    ]
    (line,) = [x for x in out.stderr.splitlines() if "training stopped" in x]
    assert "nothing left to promote: Dense_0 computes in float32 already" in line
    assert "bug in the data" in line and "bf16 policy" not in line


@pytest.mark.program
def test_an_fp8_promotion_rebuilds_the_fp8_state_and_resumes_bit_exactly(tmp_path, data_dir):
    # hidden_gain 1e39 overflows Dense_0, the seed CNN's one fp8 matmul, in any format: with
    # k = 15 it leaves fp8 at step 15 (its fp8 site goes from the state) and bfloat16 at step 30.
    # A run stopped at 20 restores a checkpoint whose fp8 sites are not the fresh model's.
    flags = {"adaptive_precision": "true", "adaptive.k": 15, "num_train_steps": 30}
    flags.update(policy="mixed_fp8", model_config="{'hidden_gain': 1e39}")
    flags.update(checkpoint_every_steps=10, log_every_steps=10, max_checkpoints_to_keep=5)
    reference = tmp_path / "reference"
    out = _cli(reference, data_dir, **flags)
    assert out.returncode == 0, out.stderr[-3000:]
    changes = [
        (c["step"], c["from_dtype"], c["to_dtype"]) for c in _records(reference, "precision_change")
    ]
    assert changes == [(15, "float8_e4m3fn", "bfloat16"), (30, "bfloat16", "float32")]
    assert "overflowed or saturated its fp8 range on 15 of the last 50 steps" in out.stderr
    sites = {
        step: set(_restored(reference, data_dir, flags, step).fp8_state.sites) for step in (10, 20)
    }
    assert sites == {10: {"Dense_0/dot_general"}, 20: set()}

    resumed = tmp_path / "resumed"
    out = _cli(resumed, data_dir, **{**flags, "num_train_steps": 20})
    assert out.returncode == 0, out.stderr[-3000:]
    out = _cli(resumed, data_dir, **flags)
    assert out.returncode == 0 and "resuming from the checkpoint at step 20" in out.stdout
    assert [c["step"] for c in _records(resumed, "precision_change")] == [15, 30]
    want = _restored(reference, data_dir, flags, 30)
    _assert_bit_identical(_restored(resumed, data_dir, flags, 30), want)


def _restored(workdir, data_dir, flags, step):
    from jamp.train import fp8_sites

    overrides = {k: v for k, v in flags.items() if k not in ("adaptive_precision", "adaptive.k")}
    overrides.update(adaptive_precision=True, model_config={"hidden_gain": 1e39})
    overrides.update(activations="compute", **{"adaptive.k": int(flags["adaptive.k"])})
    target = recipe_state(data_dir, overrides)
    with Checkpointer(workdir / "checkpoints") as ckpt:
        return ckpt.restore(target, step=step, fit=fp8_sites.Fp8Sites(None, None, adaptive=True))


@pytest.mark.parametrize("parallelism", ["pmap", "sharded"])
def test_the_fp8_state_follows_a_promotion_and_a_demotion_placed_like_the_rest(
    data_dir, parallelism
):
    from jamp import parallel, sharding
    from jamp.precision import get_policy
    from jamp.train import adapting, fp8_sites, loop

    config = runpy.run_path(str(ROOT / "configs" / "default.py"))["get_config"]()
    config.update(data_dir=str(data_dir), policy="mixed_fp8", parallelism=parallelism)
    if parallelism == "sharded":
        config.mesh = "data=2,fsdp=4"
    run, data_cfg, optim_cfg, _ = loop.parse_config(config)
    dataset, model = loop.build_model(run, data_cfg, "classification")
    tx, _ = loop.make_optimizer(optim_cfg)
    host = loop.init_state(model, tx, run.loss_scale, dataset.info, run.seed, run.fp8)
    assert list(host.fp8_state.sites) == ["Dense_0/dot_general"]
    state = (
        sharding.shard_state(host, run.mesh)
        if parallelism == "sharded"
        else parallel.replicate(host)
    )
    promoted = adapting.rewrap(model, {"Dense_0": get_policy("mixed_bfloat16")})
    fp8_state, added = fp8_sites.after_promotion(run, promoted, dataset.info, state)
    state = state.replace(fp8_state=fp8_state)
    assert state.fp8_state.sites == {} and not added
    # back in fp8 (a demotion): the site is fresh, and replicated as every fp8 site is
    fp8_state, added = fp8_sites.after_promotion(run, model, dataset.info, state)
    state = state.replace(fp8_state=fp8_state)
    assert added  # the loop's next step is a calibrating one
    (site,) = state.fp8_state.sites.values()
    for leaf in jax.tree.leaves(site):
        if parallelism == "sharded":
            assert leaf.sharding.is_fully_replicated and leaf.sharding.mesh == run.mesh
        else:
            assert leaf.shape[0] == jax.local_device_count()  # one copy per replica
    scale = parallel.unreplicate(site).scale if parallelism == "pmap" else site.scale
    np.testing.assert_array_equal(np.asarray(scale), np.ones(3, np.float32))

    # The loop's next step, calibrating, placed like the plain one: it fills the fresh site
    from jamp import fp8
    from jamp.step import make_eval_step, make_train_step
    from jamp.train import steps as steps_lib
    from jamp.train import tasks

    def calibrating_fn(axis_name):
        loss_fn = tasks.make_loss_fn(model, "classification")
        return fp8.calibrating(make_train_step(loss_fn, tx, axis_name=axis_name))

    def eval_fn(axis_name):
        return make_eval_step(tasks.make_eval_fn(model, "classification"), axis_name=axis_name)

    placement = steps_lib.place_steps(run, calibrating_fn, eval_fn, state)
    batch = placement.batch(next(dataset.train_batches(start_step=0)))
    state, metrics = placement.train_step(state, batch, jax.random.key(0))
    host = placement.host(state)
    (site,) = host.fp8_state.sites.values()
    newest = np.asarray(site.amax_history)[:, 0]
    assert np.all(newest > 0) and int(host.skipped_steps) == 0
    assert host.fp8_state.recipe == "delayed"
    np.testing.assert_allclose(np.asarray(site.scale), fp8_formats._FMAX / newest, rtol=1e-6)
