"""jamp: mixed-precision training for JAX and Flax.

The public API, all documented in the README:

* policies: `get_policy`, `describe_policy`, `PRESETS`;
* wrapping: `wrap` (linen and NNX modules), `autocast` (any JAX function; of an Equinox module,
  an `Autocast` pytree), `FP32_MODULES`,
  `UnsupportedProgramError`, `RecognitionWarning` (a pattern jamp fuses, not recognised in a
  module: it runs as traced), `module_policies` (which policy each linen submodule runs
  under); NNX training through `jamp.make_train_step`: the `jamp.nnx` module (`split`,
  `Functional`, `FP32_MODULES`);
* loss scales: `NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`, `loss_scale_for`,
  `all_finite`, `finite_by_group`, `select_tree`;
* training: `TrainState`, `make_train_step`, `make_eval_step`; the `jamp.losses` module
  (`softmax_cross_entropy_with_integer_labels`: optax's, with a fused backward that keeps no
  float32 copy of 16-bit logits);
* past float32 master weights: the `jamp.rounding` module (`stochastic_round`, `round_tree`:
  bfloat16 params, which the step updates in float32 and rounds stochastically) and the
  `jamp.lowbit` module (`bf16_state`, `int8_state`: optax optimizer state in 16 or 8 bits;
  `bytes_per_param`);
* fp8 matmuls' scaling: the `jamp.fp8` module (`init_state`, `Fp8State`, `quantize`,
  `dequantize`, `scale_for`, `RECIPES`);
* adaptive precision: the `jamp.adaptive` module (`Controller`, `AdaptiveState`, `Change`,
  `blame`, `ladder`, `placement_overrides`, `blocks`);
* the device's 16-bit support: the `jamp.hardware` module (`support`, `auto_policy`,
  `emulation_warning`, `matmul_lowering`);
* data parallelism: the `jamp.parallel` module (`replicate`, `unreplicate`, `shard`,
  `make_p_train_step`, `make_p_eval_step`);
* sharded training on a mesh: the `jamp.sharding` module (`make_mesh`, `shard_state`,
  `state_shardings`, `shard_batch`, `make_sharded_train_step`, `make_sharded_eval_step`,
  `describe`);
* GPU programs without the GPU: `compile_for` and the `jamp.target` module (`get_target`,
  `Target`, `GPUS`, `TargetUnavailable`).
"""

from jamp import (  # noqa: F401 (_startup first: it loads JAX, see the module)
    _startup,
    adaptive,
    fp8,
    hardware,
    losses,
    lowbit,
    nnx,
    parallel,
    rounding,
    sharding,
    target,
)
from jamp import jax_compat as _jax_compat
from jamp.autocast import Autocast, autocast
from jamp.engine import RecognitionWarning
from jamp.finite import all_finite, finite_by_group, select_tree
from jamp.jax_compat import UnsupportedProgramError
from jamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale, loss_scale_for
from jamp.precision import PRESETS, get_policy
from jamp.precision import describe as describe_policy
from jamp.state import TrainState
from jamp.step import make_eval_step, make_train_step
from jamp.target import compile_for
from jamp.wrap import FP32_MODULES, module_policies, wrap

# Before JAX starts its backends (nothing above starts them): see the function.
_jax_compat.allow_deviceless_cuda()

__version__ = "0.1.0.dev0"

__all__ = [
    "FP32_MODULES",
    "PRESETS",
    "RecognitionWarning",
    "DynamicLossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "TrainState",
    "UnsupportedProgramError",
    "adaptive",
    "all_finite",
    "autocast",
    "Autocast",
    "compile_for",
    "describe_policy",
    "finite_by_group",
    "fp8",
    "get_policy",
    "hardware",
    "loss_scale_for",
    "losses",
    "lowbit",
    "make_eval_step",
    "make_train_step",
    "module_policies",
    "nnx",
    "parallel",
    "rounding",
    "select_tree",
    "sharding",
    "target",
    "wrap",
]
