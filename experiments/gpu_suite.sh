#!/usr/bin/env bash
# The GPT-2-small table on one GPU, in one command that ends inside 5 minutes (gpu_suite.py).
#
#   bash experiments/gpu_suite.sh            # on a machine with a CUDA jax, flax and optax
#
# Writes gpu_suite.md, gpu_suite_rows.jsonl, gpu_suite_kernels.md and gpu_suite.log into $OUT
# (a lent device machine's folder that comes back) or experiments/results/gpu_suite/, each time a
# row lands. jamp runs from this checkout (no install). What the loaned image lacks travels as
# wheels in .whl/ (the device README's recipe): transformers 4.57.6 (the last with Flax classes),
# tokenizers 0.22.1, huggingface_hub 0.36.0, jmp 0.0.4 (and ml-collections where needed):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl transformers==4.57.6 ...
# On the device tool: run(kind="nvidia-h200", carry=[".whl"], command="bash experiments/gpu_suite.sh",
# timeout_s=330); a call that names no kind gets an H100 (its rows are then predicted for an H100).
# The expected wall time on one H200 (or H100): about 4 minutes (12 rows, 5 compiling at once
# at 17-40 s each, then 2-4 s of timing each under a lock; a torch.compile row ~40 s to its first
# step).
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
out="${OUT:-experiments/results/gpu_suite}"
# 270 s for the rows leaves room inside 5 minutes for start-up and the copy back.
python3 experiments/gpu_suite.py --out "$out" --deadline 270 "$@"
