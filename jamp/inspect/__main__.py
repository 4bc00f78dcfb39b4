"""``python -m jamp.inspect --config=<recipe> [--config.<field>=...] [--workdir=DIR]``

Prints the precision report of a recipe's train step (traced, not run: per module, forward and
backward, which dtypes its matmuls and elementwise work use, what stayed float32 and why, and
the hazards), then the float16 range table of one real batch from the recipe's data at the
initial loss scale, without training anything. With ``--workdir`` the two tables also go to
``precision_report.txt`` and ``ranges.txt`` there, with the plot ``ranges.png``.

The recipe and its overrides are read exactly as ``python -m jamp.train`` reads them (the same
names, files and ``--config.<field>`` overrides); a bad one is one line on stderr and exit
status 2.

  python -m jamp.inspect                                   # the default recipe (digits, fp16)
  python -m jamp.inspect --config=configs/lm_pydoc.py --config.policy=mixed_float16
  python -m jamp.inspect --config=cifar10_resnet --workdir=/tmp/inspect_resnet
"""

from __future__ import annotations

import functools
import os
import sys

from absl import app, logging

from jamp.train import cli as train


def _build(config):
    """What the training program builds from a recipe: settings, dataset, wrapped model, state."""
    from jamp.train import loop
    from jamp.train.optim import make_optimizer

    run, data_cfg, optim_cfg, task = loop.parse_config(config)
    dataset, model = loop.build_model(run, data_cfg, task)
    tx, _ = make_optimizer(optim_cfg)
    state = loop.fresh_state(run, model, tx, dataset.info)  # the run's own
    return run, data_cfg, task, dataset, model, tx, state


def inspect_recipe(config, workdir) -> str:
    """The report and range table of the recipe `config` (an ml_collections ConfigDict).

    Raises ConfigError / DataError (one-line messages) for bad input, before writing anything.
    """
    import jax

    from jamp.inspect.ranges import range_report
    from jamp.inspect.report import precision_report
    from jamp.precision import describe
    from jamp.train import loop, recipe_step, tasks

    path = loop.resolve_workdir(workdir) if workdir else None
    run, data_cfg, task, dataset, model, tx, state = _build(config)
    loss_fn = recipe_step.loss_fn(run, model, task)
    # What one device runs under jit (pmap adds the replicas' averaging), on the global batch:
    # the run's own step (`recipe_step`), its parameter rounding and reduce dtype included.
    step = recipe_step.train_step(run, model, task, tx)
    batch = next(iter(dataset.train_batches(start_step=0)))
    rng = jax.random.key(run.seed)
    report = precision_report(step, state, batch, rng)
    ranges = range_report(
        model,
        {"params": state.params, **state.model_state},
        tasks.model_inputs(task, batch),
        loss_fn=lambda params: loss_fn(params, state.model_state, batch, rng)[0],
        loss_scale=state.loss_scale,
        train=True,
        rngs={"dropout": rng},
        mutable=list(state.model_state),
    )
    title = f"{run.model} on {data_cfg.dataset}, batch {run.batch_size}, {describe(run.policy)}"
    text = f"{title}\n\n{report.table()}\n\n{ranges.table()}"
    if path is not None:
        path = loop.prepare_workdir(path)
        (path / "precision_report.txt").write_text(report.table() + "\n")
        (path / "ranges.txt").write_text(ranges.table() + "\n")
        ranges.plot(path / "ranges.png")
        text += f"\n\nwritten: {path / 'precision_report.txt'}, ranges.txt, ranges.png"
    return text


def main(argv, config, workdir) -> None:
    if len(argv) > 1:
        train._fail(f"unexpected arguments {argv[1:]}; pass settings as --config.<field>=<value>")
    # As quiet as the training program: its log filter, and no TensorFlow start-up banners.
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_handler().addFilter(
        lambda r: not any(noise in r.getMessage() for noise in train._LOG_NOISE)
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    from jamp.train import loop
    from jamp.train.data import DataError

    try:
        resolved = config.value.to_dict() and config.value  # loads the recipe file now
    except Exception as e:  # ml_collections defers a missing or broken recipe to first use
        train._fail(f"cannot load the config file: {train._one_line(e, last=True)}")
    try:
        text = inspect_recipe(resolved, workdir.value)
    except (loop.ConfigError, DataError) as e:
        train._fail(str(e))
    print(text, flush=True)


def run() -> None:
    # The recipe flags are jamp.train's own: the same names, files and overrides.
    sys.argv = train._resolve_recipe_args(sys.argv)
    try:
        config, workdir = train._define_flags()
    except (KeyError, AttributeError) as e:
        train._fail(f"unknown config field {train._one_line(e)}; see the recipe file")
    except Exception as e:
        train._fail(f"cannot load the config: {train._one_line(e)}")
    app.run(
        functools.partial(main, config=config, workdir=workdir), flags_parser=train._parse_flags
    )


if __name__ == "__main__":
    run()
