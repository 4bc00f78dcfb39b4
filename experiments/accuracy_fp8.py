"""fp8 at equal budget: mixed_fp8 (delayed and current scaling) against float32 and mixed_bfloat16.

    python experiments/accuracy_fp8.py              # 2 recipes, 2 seeds, 31-37 min
    python experiments/accuracy_fp8.py --recipes lm --seeds 1 --steps 100
    python experiments/accuracy_fp8.py --recipes digits --seeds 1 --steps 20

Every jamp run is the real training program (`python -m jamp.train`) with only the policy, the fp8
recipe and the seed changed, so each policy gets the same init, data order, steps and optimizer:

* lm: configs/lm_pydoc.py (byte-level Transformer LM on CPython's pydoc text, 600 steps);
  metric: the final test loss in nats per byte;
* digits: configs/default.py (the seed CNN on scikit-learn's 8x8 digits, 1000 steps), as
  accuracy_digits.py runs it; metric: the final eval accuracy (300 test images), with the test
  loss beside it (the accuracy is near 100 % for every policy).

Policies: float32, mixed_bfloat16 (the reference: fp8 replaces its bf16 layer matmuls), and
mixed_fp8 with `--config.fp8_recipe=delayed` and `=current` (E4M3 operands forward, E5M2 gradients
backward, fp32 accumulation; the output head, embeddings and convolutions stay bf16).

On the LM it also trains the Flax peer (experiments/_fp8_peer.py): the same TransformerLM
structure written with `flax.linen.fp8_ops.Fp8DirectDotGeneralOp` as the layers' dot_general
class, bf16 everywhere else, trained by a hand-written step on the program's data, init and
optimizer; and the same peer without fp8 (its bf16 reference, so its fp8 cost can be read off the
same way).

The final params of every fp8 run are also evaluated again with bf16 matmuls (a fresh process
restores the run's checkpoint; the peer does it itself): the part of the gap that survives is what
fp8 training did to the weights, the rest is fp8 at inference (`--no_bf16_eval` skips it).

The bar (the issue's): mixed_fp8 within 2 % of mixed_bfloat16's test loss on the LM and within 0.5
accuracy points on digits, as the mean of the per-seed (paired) differences. It writes
experiments/results/accuracy_fp8_cpu.md (tables, verdicts) and .png (training loss per policy for
each recipe, its difference to mixed_bfloat16's, and the amax and scale of one fp8 site of the
delayed run over steps). On a CPU the
fp8 matmuls are emulated (XLA converts to float32): the numbers are about accuracy, not speed.
Committed: `--seeds 2` with the peer (accuracy_fp8_cpu.md) and `--seeds 3 --no_peer
--out experiments/results/accuracy_fp8_seeds3_cpu.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from _accuracy import add_run_arguments, final, records, run, run_options
from _harness import RESULTS, ROOT
from _harness.environment import cpu_cores, environment, versions
from _harness.plots import pyplot, save
from _harness.tables import mean_sd, paired, write_page

REFERENCE = "mixed_bfloat16"
# label -> (policy, extra --config flags) of the program's runs
POLICIES = {
    "float32": ("float32", []),
    "mixed_bfloat16": ("mixed_bfloat16", []),
    "mixed_fp8 delayed": ("mixed_fp8", ["--config.fp8_recipe=delayed"]),
    "mixed_fp8 current": ("mixed_fp8", ["--config.fp8_recipe=current"]),
}
DELAYED = "mixed_fp8 delayed"
FP8 = ("mixed_fp8 delayed", "mixed_fp8 current")
# label -> _fp8_peer.py --dot
PEERS = {"flax fp8_ops (peer)": "fp8", "flax bf16 by hand (peer reference)": "bf16"}
PEER_FP8, PEER_REF = PEERS
RECIPES = {
    "lm": dict(
        config="configs/lm_pydoc.py",
        steps=600,
        metric="loss",
        title="byte-level Transformer LM on pydoc (configs/lm_pydoc.py)",
        bar=2.0,  # % of the reference's test loss
    ),
    "digits": dict(
        config=None,  # the program's default recipe, configs/default.py
        steps=1000,
        metric="accuracy",
        title="seed CNN on digits (configs/default.py)",
        bar=0.5,  # accuracy points
    ),
}


def overrides(recipe: str, steps: int) -> list[str]:
    if recipe == "lm":  # the recipe's 60 warmup steps of 600, also for shorter runs
        return [f"--config.warmup_steps={max(1, steps // 10)}"]
    return []


def run_peer(dot: str, seed: int, steps: int, workdir: pathlib.Path, data_dir: str):
    """One peer run on the LM recipe: (its metrics.jsonl records, None, its fp8 op count) or
    (None, the error's last line, None)."""
    cmd = [
        sys.executable, str(ROOT / "experiments" / "_fp8_peer.py"), f"--workdir={workdir}",
        f"--seed={seed}", f"--steps={steps}", f"--warmup={max(1, steps // 10)}", f"--dot={dot}",
    ]  # fmt: skip
    if data_dir:
        cmd.append(f"--data_dir={data_dir}")
    # The jamp of this checkout, as `python -m jamp.train` in ROOT imports it (not an install's).
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        return None, (lines[-1] if lines else f"exit status {out.returncode}"), None
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    sites = json.loads((workdir / "peer.json").read_text())["fp8_sites"]
    return [json.loads(line) for line in lines], None, len(sites)


def eval_in_bf16(workdir: pathlib.Path) -> dict:
    """The final test metrics of a program run's checkpointed params under mixed_bfloat16.

    For an fp8 run this separates what fp8 did to the trained weights from what it does to
    inference: the same params, evaluated with bf16 matmuls instead of fp8 ones."""
    import jax
    import ml_collections

    from jamp.step import make_eval_step
    from jamp.train import loop, tasks
    from jamp.train.checkpoint import Checkpointer
    from jamp.train.optim import make_optimizer

    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    run, data_cfg, optim_cfg, task = loop.parse_config(config)
    dataset, model = loop.build_model(run, data_cfg, task)
    tx, _ = make_optimizer(optim_cfg)
    target = loop.init_state(model, tx, run.loss_scale, dataset.info, run.seed, run.fp8)
    with Checkpointer(workdir / "checkpoints") as checkpointer:
        state = checkpointer.restore(target).replace(fp8_state=None)
    config.policy = REFERENCE
    bf16_run, *_ = loop.parse_config(config)
    _, bf16_model = loop.build_model(bf16_run, data_cfg, task)
    step = jax.jit(make_eval_step(tasks.make_eval_fn(bf16_model, task)))
    totals = None
    for batch in dataset.eval_batches():
        sums = jax.device_get(step(state, batch))
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    return tasks.summarize_eval(task, totals)


def run_eval_in_bf16(workdir: pathlib.Path) -> dict:
    """`eval_in_bf16` in a fresh process (this one imports no jax)."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), f"--eval_in_bf16={workdir}"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"evaluating {workdir} in bf16 failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pct(values: list[float], ref: list[float]) -> list[float]:
    """Per-seed differences to the reference, in % of the reference (losses)."""
    return [100 * (v - r) / r for v, r in zip(values, ref)]


def points(values: list[float], ref: list[float]) -> list[float]:
    """Per-seed differences to the reference, in points (accuracies)."""
    return [100 * (v - r) for v, r in zip(values, ref)]


def first_site(run_records: list[dict]) -> str | None:
    """The first fp8 site the run's metrics name (jamp: the program's first fp8 matmul)."""
    for r in records(run_records, "train"):
        for key in r:
            if key.startswith("fp8/") and key.endswith("/x_amax"):
                return key[len("fp8/") : -len("/x_amax")]
    return None


def plot(curves: dict, recipes: list[str], path: pathlib.Path) -> bool:
    """Per recipe (column), seed 0: the training loss per policy; its difference to
    mixed_bfloat16's; one delayed fp8 site's amax and scale over steps."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(3, len(recipes), figsize=(7 * len(recipes), 13), squeeze=False)
    for col, recipe in enumerate(recipes):
        ref = {r["step"]: r["loss"] for r in records(curves[recipe][REFERENCE], "train")}
        ax, ax_diff = axes[0][col], axes[1][col]
        for label, run_records in curves[recipe].items():
            train, evals = records(run_records, "train"), records(run_records, "eval")
            style = ":" if label in PEERS else "-"
            steps = [r["step"] for r in train]
            (line,) = ax.plot(steps, [r["loss"] for r in train], style, label=label, lw=1.2)
            if recipe == "lm":
                ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o",
                        color=line.get_color(), markersize=4)  # fmt: skip
            if label != REFERENCE:
                ax_diff.plot(steps, [r["loss"] - ref[r["step"]] for r in train], style,
                             color=line.get_color(), label=label, lw=1.2)  # fmt: skip
        ax.set(yscale="log", xlabel="step", ylabel="training loss (10-step window mean)",
               title=f"{recipe}: training loss, seed 0" +
               (" (dots: test loss)" if recipe == "lm" else ""))  # fmt: skip
        ax.legend(fontsize=8)
        ax_diff.axhline(0.0, color="black", lw=0.6)
        ax_diff.set(xlabel="step", ylabel=f"training loss minus {REFERENCE}'s",
                    title=f"{recipe}: training loss minus {REFERENCE}'s, same seed "
                    "and batches")  # fmt: skip
        if recipe == "digits":
            ax_diff.set_yscale("symlog", linthresh=1e-4)
        ax_diff.legend(fontsize=8)
        ax = axes[2][col]
        delayed = curves[recipe].get(DELAYED)
        site = first_site(delayed) if delayed else None
        if site is None:
            ax.set_axis_off()
            continue
        train = records(delayed, "train")
        steps = [r["step"] for r in train]
        twin = ax.twinx()
        for row, what, color in (("x", "activation", "C0"), ("w", "weight", "C1"),
                                 ("g", "gradient", "C2")):  # fmt: skip
            ax.plot(steps, [r[f"fp8/{site}/{row}_amax"] for r in train], "-", color=color,
                    label=f"{row} ({what}) amax")  # fmt: skip
            twin.plot(steps, [r[f"fp8/{site}/{row}_scale"] for r in train], "--", color=color,
                      label=f"{row} scale")  # fmt: skip
        ax.set(yscale="log", xlabel="step", ylabel="amax (solid)")
        ax.set_title(f"{recipe}, {DELAYED}, seed 0: {site}", fontsize=8)
        twin.set(yscale="log", ylabel="scale = fmax / max(amax history) (dashed)")
        lines, more = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, ncol=3,
                  loc="upper center", bbox_to_anchor=(0.5, -0.12))  # fmt: skip
    return save(fig, path)


def recipe_table(recipe: str, runs: dict, errors: dict) -> list[str]:
    """The recipe's results table, the verdicts against the bar, and where the fp8 gap is."""
    bar = RECIPES[recipe]["bar"]
    col = {label: {k: [r[k] for r in rs] for k in rs[0]} for label, rs in runs.items() if rs}
    ref = col[REFERENCE]
    if recipe == "lm":
        lines = [
            "| policy | test loss per seed (nats/byte) | mean ± sd | vs mixed_bfloat16, same "
            "seed (% of its loss) | next-byte accuracy | s per run |",
            "|---|---|---|---|---|---|",
        ]
    else:
        lines = [
            "| policy | accuracy per seed | mean ± sd (points) | vs mixed_bfloat16, same seed "
            "(points) | test loss (nats) | vs mixed_bfloat16 (% of its loss) | s per run |",
            "|---|---|---|---|---|---|---|",
        ]
    for label in runs:
        if label in errors:
            lines.append(
                f"| {label} | failed: `{errors[label]}` |" + " |" * (lines[1].count("|") - 3)
            )
            continue
        c = col[label]
        is_ref = label == REFERENCE
        if recipe == "lm":
            lines.append(
                f"| {label} | {', '.join(f'{v:.4f}' for v in c['loss'])} | {mean_sd(c['loss'])} "
                f"| {'(reference)' if is_ref else paired(pct(c['loss'], ref['loss']))} "
                f"| {mean_sd(c['accuracy'])} | {statistics.mean(c['seconds']):.0f} |"
            )
        else:
            lines.append(
                f"| {label} | {', '.join(f'{v:.4f}' for v in c['accuracy'])} "
                f"| {mean_sd(c['accuracy'], 100, 2)} "
                f"| {'(reference)' if is_ref else paired(points(c['accuracy'], ref['accuracy']))} "
                f"| {mean_sd(c['loss'], 1, 5)} "
                f"| {'(reference)' if is_ref else paired(pct(c['loss'], ref['loss']))} "
                f"| {statistics.mean(c['seconds']):.0f} |"
            )
    lines.append("")
    metric, unit = ("loss", "% of the loss") if recipe == "lm" else ("accuracy", "points")
    measure = pct if recipe == "lm" else points
    for label in FP8:
        d = measure(col[label][metric], ref[metric])
        verdict = "within" if abs(statistics.mean(d)) <= bar else "OUTSIDE"
        lines.append(
            f"- {label} vs {REFERENCE}, test {metric}: {statistics.mean(d):+.2f} {unit} (mean "
            f"over {len(d)} seeds; worst seed {max(d, key=abs):+.2f}): {verdict} the bar of "
            f"{bar:g} {unit}."
        )
    if recipe == "lm" and PEER_FP8 in col and PEER_REF in col:
        d = pct(col[PEER_FP8]["loss"], col[PEER_REF]["loss"])
        lines.append(f"- {PEER_FP8} vs {PEER_REF} (the peer's own fp8 cost): {paired(d)} {unit}.")
    # Where the gap is: the fp8-trained params evaluated with bf16 matmuls.
    rows = [label for label in (*FP8, PEER_FP8) if label in col and "bf16_loss" in col[label]]
    if rows:
        base = {PEER_FP8: col.get(PEER_REF, ref)}
        lines += [
            "",
            "The fp8-trained params evaluated again with bf16 matmuls (the same weights, no fp8 "
            "at inference): what is left of the gap is what fp8 training did to the weights.",
            "",
            "| trained as | its reference | test loss, fp8 inference | same params, bf16 "
            "inference | gap, fp8 inference (%) | gap, bf16 inference (%) |",
            "|---|---|---|---|---|---|",
        ]
        for label in rows:
            c, r = col[label], base.get(label, ref)
            name = PEER_REF if label == PEER_FP8 else REFERENCE
            lines.append(
                f"| {label} | {name} | {mean_sd(c['loss'], 1, 5)} "
                f"| {mean_sd(c['bf16_loss'], 1, 5)} | {paired(pct(c['loss'], r['loss']))} "
                f"| {paired(pct(c['bf16_loss'], r['loss']))} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="0: each recipe's own (600, 1000)")
    parser.add_argument("--recipes", default="lm,digits", help="comma-separated: lm, digits")
    parser.add_argument("--no_peer", action="store_true", help="skip the Flax fp8_ops peer")
    parser.add_argument("--no_bf16_eval", action="store_true",
                        help="skip evaluating the fp8-trained params again in bf16")  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS / "accuracy_fp8_cpu.md"))
    parser.add_argument("--eval_in_bf16", help=argparse.SUPPRESS)  # WORKDIR: the helper mode
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.eval_in_bf16:
        print(json.dumps(eval_in_bf16(pathlib.Path(args.eval_in_bf16))))
        return
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        parser.error(f"--recipes: unknown {unknown}; accepted: {', '.join(RECIPES)}")

    start = time.perf_counter()
    # recipe -> label -> one dict per seed: final test loss and accuracy, seconds, skipped steps
    # and, for fp8 runs, bf16_loss / bf16_accuracy (the same params evaluated in bf16)
    results = {r: {} for r in recipes}
    errors = {r: {} for r in recipes}  # recipe -> label -> the peer's error
    curves = {r: {} for r in recipes}  # seed 0's records
    peer_sites = {}  # peer label -> its number of flax fp8 ops
    config = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for recipe in recipes:
                spec = RECIPES[recipe]
                steps = args.steps or spec["steps"]
                jobs = [(label, None) for label in POLICIES]
                if recipe == "lm" and not args.no_peer:
                    jobs += [(label, dot) for label, dot in PEERS.items()]
                for label, dot in jobs:
                    workdir = pathlib.Path(tmp) / f"{recipe}-{label.replace(' ', '_')}-{seed}"
                    t0 = time.perf_counter()
                    if dot is None:
                        policy, extra = POLICIES[label]
                        run_records = run(policy, seed, steps, workdir, args.data_dir,
                                          spec["config"], overrides=overrides(recipe, steps) +
                                          extra, activations=args.activations)  # fmt: skip
                        config.setdefault(recipe, json.loads((workdir / "config.json").read_text()))
                        seconds = time.perf_counter() - t0
                        if label in FP8 and not args.no_bf16_eval:
                            run_records.append(dict(run_eval_in_bf16(workdir), kind="eval_bf16"))
                    else:
                        run_records, error, n = run_peer(dot, seed, steps, workdir, args.data_dir)
                        peer_sites[label] = n
                        if error is not None:
                            errors[recipe][label] = error
                            results[recipe].setdefault(label, [])
                            print(f"{recipe:6s} {label:34s} seed {seed}: failed: {error}")
                            continue
                        seconds = time.perf_counter() - t0
                    ev = final(run_records)
                    skips = final(run_records, "train").get("skipped_steps", 0)
                    result = dict(loss=ev["loss"], accuracy=ev["accuracy"], seconds=seconds,
                                  skipped=skips)  # fmt: skip
                    if records(run_records, "eval_bf16"):
                        bf16 = final(run_records, "eval_bf16")
                        result.update(bf16_loss=bf16["loss"], bf16_accuracy=bf16["accuracy"])
                    results[recipe].setdefault(label, []).append(result)
                    if seed == 0:
                        curves[recipe][label] = run_records
                    print(f"{recipe:6s} {label:34s} seed {seed}: test loss {ev['loss']:.4f}, "
                          f"accuracy {ev['accuracy']:.4f}, {seconds:.0f} s" +
                          (f"; in bf16: test loss {result['bf16_loss']:.4f}"
                           if "bf16_loss" in result else ""), flush=True)  # fmt: skip
    minutes = (time.perf_counter() - start) / 60

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plotted = plot(curves, recipes, out.with_suffix(".png"))
    command = f"python experiments/accuracy_fp8.py --seeds {args.seeds} --recipes {args.recipes}"
    if args.steps:
        command += f" --steps {args.steps}"
    if args.no_peer:
        command += " --no_peer"
    if args.no_bf16_eval:
        command += " --no_bf16_eval"
    command += run_options(args)
    runs = sum(len(v) for r in recipes for v in results[r].values())
    lines = [
        "# fp8 at equal budget: mixed_fp8 against float32 and mixed_bfloat16 (CPU, fp8 emulated)",
        "",
        *environment(
            command,
            f"{cpu_cores()}, CPU only (a VM shared with other jobs): fp8 matmuls are emulated "
            "(XLA converts the fp8 operands to float32), so the seconds say nothing about fp8 "
            "speed; " + versions("jax", "jaxlib", "flax", "optax", "jmp", python_first=True),
            took=f"{minutes:.1f} min for {runs} runs",
            commit=True,
        ),
        f"- each jamp run: `python -m jamp.train` with only --config.policy, --config.fp8_recipe "
        f"and --config.seed changed; activations={args.activations!r} (auto: float32 between "
        "matmuls on CPUs); mixed_fp8: amax history 16, margin 0 (the defaults); E4M3 operands "
        "forward, E5M2 gradients backward, fp32 accumulation; output head, embeddings and "
        "convolutions bf16",
        '- mean ± sd over seeds; "vs mixed_bfloat16" is the mean of the per-seed differences (a '
        "seed fixes the init and the data order for every policy) [smallest, largest]",
    ]
    for recipe in recipes:
        spec, c = RECIPES[recipe], config[recipe]
        steps = args.steps or spec["steps"]
        lines += ["", f"## {recipe}: {spec['title']}", ""]
        if recipe == "lm":
            m = c["model_config"]
            lines.append(
                f"{m['num_layers']}-layer Transformer, d_model {m['d_model']}, {m['num_heads']} "
                f"heads, MLP {m['mlp_dim']}; {c['optimizer']} {c['learning_rate']:g} "
                f"({c['schedule']}, {c['warmup_steps']} warmup steps), weight decay "
                f"{c['weight_decay']:g}, grad-norm clip {c['max_grad_norm']:g}; batch "
                f"{c['batch_size']} x {c['seq_len']} bytes, {steps} steps; the test loss is over "
                "every byte of the test windows (the pydoc text of the running Python)."
            )
            if not args.no_peer:
                lines += [
                    "",
                    f"The peers (experiments/_fp8_peer.py) train the same TransformerLM structure "
                    "(same parameter names, the program's initial parameters, data batches, "
                    "optimizer, schedule and clipping) with a hand-written step, in bf16 "
                    "everywhere (`dtype=bfloat16, param_dtype=float32`, LayerNorm and residuals "
                    "too, unlike jamp's CPU default); "
                    f"{PEER_FP8}: `flax.linen.fp8_ops.Fp8DirectDotGeneralOp` "
                    "(amax history 16 as jamp's) as the dot_general class of the MLP's Dense "
                    "layers and of the attention's q, k, v and out projections "
                    f"({peer_sites.get(PEER_FP8)} fp8 matmuls); its `_overwrite_with_gradient` "
                    "variables are replaced by their 'gradients' through flax's "
                    "`TrainState.apply_gradients` and kept out of the clipping and the "
                    f"optimizer; {PEER_REF}: the same without fp8.",
                ]
        else:
            lines.append(
                f"{c['optimizer']} {c['learning_rate']:g}, batch {c['batch_size']}, {steps} "
                "steps; 300 test images (one image is 0.33 points). Under mixed_fp8 only the "
                "hidden Dense layer is fp8 (the convolutions and the output head stay bf16)."
            )
        lines += [""] + recipe_table(recipe, results[recipe], errors[recipe])
        skipped = {k: [r["skipped"] for r in v] for k, v in results[recipe].items()}
        nonzero = {k: v for k, v in skipped.items() if any(v)}
        lines.append("")
        lines.append(
            "- skipped steps (non-finite gradients): "
            + (", ".join(f"{k} {v}" for k, v in nonzero.items()) if nonzero else "none in any run")
            + "."
        )
    write_page(out, lines, "training loss and fp8 scaling" if plotted else "")


if __name__ == "__main__":
    main()
