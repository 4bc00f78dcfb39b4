"""Shared by the accuracy-at-equal-budget experiments: run the real training program, read its logs.

Every run is `python -m jamp.train` in a subprocess with only the policy, seed, step count and log
interval changed on the command line, so that each policy gets the same data, steps and optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence

from _harness import ROOT

# float32; the mixed policies (fp32 params, 16-bit compute; fp16 with jamp's default dynamic loss
# scale); and all-bf16 ("bfloat16": params, compute and output bf16; since 2026-12-03 the params
# take a float32 update rounded stochastically, see accuracy_master_weights.py).
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", "bfloat16")


def train(
    flags: Sequence[str], workdir: pathlib.Path, config: str | None = None
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`python -m jamp.train` of `config` (None: the program's default recipe) with `flags`, from
    the checkout's root: the finished process and its metrics.jsonl ([] where it wrote none)."""
    cmd = [sys.executable, "-m", "jamp.train"] + ([f"--config={config}"] if config else [])
    cmd += [f"--workdir={workdir}", *flags]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    path = pathlib.Path(workdir) / "metrics.jsonl"
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return out, found


def run(
    policy: str,
    seed: int,
    steps: int,
    workdir: pathlib.Path,
    data_dir: str,
    config: str | None = None,
    log_every: int = 10,
    overrides: Sequence[str] = (),
    activations: str = "auto",
) -> list[dict]:
    """One training run of `config` (None: the program's default recipe); its metrics.jsonl.

    `overrides` are further `--config.<field>=<value>` flags, the same for every policy.
    """
    flags = [
        f"--config.policy={policy}", f"--config.seed={seed}",
        f"--config.num_train_steps={steps}", f"--config.log_every_steps={log_every}",
        f"--config.activations={activations}", *overrides,
    ]  # fmt: skip
    if data_dir:
        flags.append(f"--config.data_dir={data_dir}")
    out, found = train(flags, workdir, config)
    if out.returncode:
        raise SystemExit(f"{policy} seed {seed} failed:\n{out.stderr[-2000:]}")
    (workdir / "stdout.txt").write_text(out.stdout)  # the run's log and summary table
    return found


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every accuracy script passes through to its runs."""
    parser.add_argument("--data_dir", default="", help="tfds data_dir (default: tfds's)")
    parser.add_argument("--activations", default="auto", help="--config.activations of every run")


def run_options(args: argparse.Namespace) -> str:
    """Those of `add_run_arguments`' options a command line set, as it set them (for the record)."""
    text = f" --data_dir {args.data_dir}" if args.data_dir else ""
    return text + (f" --activations {args.activations}" if args.activations != "auto" else "")


def records(run_records: list[dict], kind: str) -> list[dict]:
    """The "train" or "eval" records of one run, in step order."""
    return [r for r in run_records if r["kind"] == kind]


def final(run_records: list[dict], kind: str = "eval") -> dict:
    """The last record of `kind` (by default the final evaluation)."""
    return records(run_records, kind)[-1]
