#!/usr/bin/env bash
# The benchmark suite on a GPU, in one command that ends inside 8 minutes.
#
#   bash experiments/gpu_suite.sh            # on a machine with a CUDA jax, flax and optax
#
# Writes experiments/results/<gpu>-x<count>.md and .png (and copies both to $OUT when that is set,
# as on a lent device machine). jamp runs from this checkout (no install); a missing pure-Python
# dependency (jmp, ml-collections) can be carried as wheels in .whl/, made on a machine with pip:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl jmp==0.0.4
# What it measures: experiments/suite.py's docstring. On a GPU the fp32 baseline is TF32
# (float32) and true fp32 (float32_highest) side by side, a GPT-2-small-sized LM at sequence 1024
# joins the workloads, and MFU is reported against the chip's dense peak. The PyTorch peer is
# CPU-only and left out here.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/jamp-site .whl/*.whl
  export PYTHONPATH="/tmp/jamp-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import jax; assert jax.default_backend() == 'gpu', 'no GPU: ' + jax.default_backend()"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# 470 s for the suite leaves room inside 8 minutes for start-up and the copy.
timeout 470 python3 experiments/suite.py --no-torch "$@"
if [ -n "${OUT:-}" ]; then
  stem=$(python3 -c "import sys; sys.path.insert(0, 'experiments'); from _xla import machine_name; print(machine_name())")
  cp "experiments/results/$stem.md" "$OUT/" && cp "experiments/results/$stem.png" "$OUT/" || true
fi
