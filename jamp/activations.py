"""Which dtype each non-matmul operation runs in when activations are kept in 16 bits.

Under a mixed policy a matmul's result may stay in the compute dtype ("16-bit activations",
`activations="compute"`) instead of going back to float32. Then every operation downstream sees a
mix of 16-bit and float32 inputs, and this module decides, per operation, what it runs in:

* numerically fragile operations (sums, exponentials, logarithms, `pow`, cumulative sums; with
  float16 also squares and integer powers, which leave its range first) run in float32, as
  traced: their 16-bit inputs are cast up, as PyTorch's autocast does;
* shape, selection and plain elementwise operations (add, mul, tanh, max, reshape, where, ...)
  run in the widest dtype among their *strong* float inputs; *weak* inputs (literals, constants,
  the model's variables and anything computed from those alone, e.g. a broadcast bias) take that
  dtype. So `x @ w + b` stays 16-bit, while a 16-bit branch added to a float32 residual stream
  gives float32 (as in PyTorch), and a softmax's normalisation divides in float32;
* a value computed from data (an embedding looked up by token ids, a padding mask) is strong
  even when the table it indexes is a variable;
* everything else runs as traced, on inputs cast back to their traced dtypes. Sub-programs
  (`scan`, `cond`, `while_loop` bodies) keep their signature; inside them the same rules apply,
  with the carried state strong.

Which form is faster depends on the platform: on GPUs and TPUs elementwise work is bound by memory
bandwidth and 16-bit activations halve it; XLA:CPU computes 16-bit elementwise math in float32
after converting, so there float32 activations are faster (`activations="auto"` picks per
platform).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from jamp import hardware

ACTIVATIONS = ("auto", "compute", "float32")

_F32 = np.dtype(jnp.float32)

#: Run in float32 whatever their inputs (sums, and the functions whose 16-bit results lose the
#: most: exponentials, logarithms, powers).
FP32_PRIMITIVES = frozenset(
    {
        "reduce_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "pow",
        "rsqrt",
        "tan",
        "sinh",
        "cosh",
        "asin",
        "acos",
        "erf_inv",
        "lgamma",
        "digamma",
    }
)

#: Run in float32 when the compute dtype is float16, whose range their results leave first
#: (`mul` of a value by itself counts as a square).
FP16_RANGE_PRIMITIVES = frozenset({"integer_pow", "square"})

#: Take any float dtype, as long as their float operands share it; their float results have it.
POLYMORPHIC_PRIMITIVES = frozenset(
    {
        # arithmetic and elementwise functions
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "rem",
        "max",
        "min",
        "neg",
        "abs",
        "sign",
        "floor",
        "ceil",
        "round",
        "square",
        "sqrt",
        "integer_pow",
        "tanh",
        "logistic",
        "erf",
        "erfc",
        "sin",
        "cos",
        "clamp",
        "select_n",
        "is_finite",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "stop_gradient",
        "copy",
        "copy_p",
        "reduce_precision",
        # exact in any dtype
        "reduce_max",
        "reduce_min",
        "argmax",
        "argmin",
        # shape and data movement
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "split",
        "pad",
        "rev",
        "gather",
    }
)


def resolve(activations: str) -> str:
    """`"auto"` -> `"float32"` when the program is traced for a CPU and `"compute"` for any other
    device (`jamp.hardware.target_platform`: a GPU target compiled on a CPU host gets "compute");
    checks the value."""
    if activations not in ACTIVATIONS:
        raise ValueError(
            f"activations={activations!r} is not one of {', '.join(map(repr, ACTIVATIONS))}."
        )
    if activations == "auto":
        activations = "float32" if hardware.target_platform() == "cpu" else "compute"
    return activations


def note(form: str, compute_dtype) -> None:
    """Records, under `jamp.hardware.compiling_for`, the activation form a program traced with a
    16-bit (or fp8) compute dtype runs in (a float32 policy has none to record)."""
    record = hardware.tracing()
    if record is not None and compute_dtype is not None and np.dtype(compute_dtype).itemsize < 4:
        record.activations.add(form)


def is_lowerable(dtype) -> bool:
    """Values traced in float32 are the ones that may be carried in 16 bits."""
    return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype) == _F32


def runs_in_fp32(primitive: str, compute_dtype) -> bool:
    """Whether the operation runs in float32 whatever its operands' dtypes."""
    if primitive in FP32_PRIMITIVES:
        return True
    # fp16 tops out at 65504: a square overflows from 256 on (an RMSNorm, a norm). bf16 has
    # float32's range, and squares there cost no more precision than any other bf16 operation.
    return is_range_guard(primitive, compute_dtype)


def is_range_guard(primitive: str, compute_dtype) -> bool:
    """Whether the operation runs in float32 only for float16's range (a square, a power)."""
    return primitive in FP16_RANGE_PRIMITIVES and np.dtype(compute_dtype) == np.float16


def run_dtype(
    traced: list[np.dtype],
    current: list[np.dtype],
    weak: list[bool],
) -> Optional[np.dtype]:
    """The dtype a polymorphic operation runs its float32-traced operands in, or None: as traced.

    Args:
      traced: each operand's dtype as traced.
      current: each operand's dtype now (a float32-traced value may be carried in 16 bits).
      weak: whether each operand is weak (a literal, constant or variable, or made of those).
    """
    strong = {c for t, c, w in zip(traced, current, weak) if is_lowerable(t) and not w}
    if not strong or _F32 in strong or len(strong) > 1:
        return None
    return strong.pop()
