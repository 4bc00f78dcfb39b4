"""`rewrite(fn, compute_dtype)`: a function's traced program evaluated again under a compute
dtype, and `placing`, the sharded parameters' context it reads."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import functools
from typing import Callable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from jamp import activations as act
from jamp import mixed_ops, scopes
from jamp.engine._context import ComputeFor, Context
from jamp.engine._core import eval_jaxpr
from jamp.engine._subprograms import changes

#: `(key_path, shape) -> (sharding, gathered) or None`: where a leaf of a weak argument (a
#: model's variables) lives on a mesh, and where a matmul reads it (None: where XLA picks);
#: `key_path` is the leaf's `jax.tree_util` key path within its argument.
PlacementFor = Callable[
    [tuple, tuple], Optional[tuple[jax.sharding.Sharding, Optional[jax.sharding.Sharding]]]
]

_PLACEMENT: contextvars.ContextVar[Optional[PlacementFor]] = contextvars.ContextVar(
    "jamp_autocast_placement", default=None
)


@contextlib.contextmanager
def placing(placement_for: PlacementFor):
    """While a function is traced in this context, `autocast` treats the weak-argument leaves that
    `placement_for` places as sharded parameters: each matmul casts them to the compute dtype on
    their own shard and reads them gathered as `placement_for` says, so the gather moves 16-bit
    values (once, for forward and backward), and hands their gradients back in the reduce dtype,
    constrained to the same sharding (see `jamp.mixed_ops.Placed`).
    Values are unchanged: shardings only say where they live. `jamp.sharding`'s steps set it."""
    token = _PLACEMENT.set(placement_for)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


#: Where recognised attention runs fused: everywhere (True), nowhere (False), or by module path:
#: a mapping of fnmatch patterns to True / False, the first that matches the path (or the
#: nearest enclosing part of it; with or without the model's own name first) deciding, fused
#: where none does.
AttentionFusion = Union[bool, Mapping[str, bool]]


def fusion_key(spec: AttentionFusion) -> Union[bool, tuple[tuple[str, bool], ...]]:
    """A `fuse_attention=` argument checked, as a hashable value (a module's field); a bad one
    fails here, in one line."""
    if isinstance(spec, bool):
        return spec
    pairs = tuple(spec.items()) if isinstance(spec, Mapping) else spec
    if not isinstance(pairs, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], bool)
        for p in pairs
    ):
        raise TypeError(
            f"fuse_attention={spec!r}: expected True, False, or a mapping of module path "
            'patterns to True / False, e.g. {"*/cross_attn": False}.'
        )
    return pairs


def attention_fusion(spec) -> Union[bool, Callable[[str], bool]]:
    """The engine's form of a `fuse_attention=` argument (or of its `fusion_key`)."""
    pairs = fusion_key(spec)
    if isinstance(pairs, bool):
        return pairs

    @functools.lru_cache(maxsize=None)
    def fuses(path: str) -> bool:
        parts = [p for p in scopes.plain(path).split("/") if p]
        for n in range(len(parts), 0, -1):  # the innermost part of the path first
            # (with the model's own name first, as its name stack has it, and without, as a
            # module's path in its variables reads)
            for pattern, fused in pairs:
                if any(fnmatch.fnmatchcase("/".join(parts[i:n]), pattern) for i in (0, 1)):
                    return fused
        return True

    return fuses


def _inherit(eqn, inherited):
    del eqn
    return inherited


@contextlib.contextmanager
def _cudnn_attention_traced_in_xla_form(compute_dtype, fuse_attention: AttentionFusion):
    """While a model is traced for a 16-bit policy, `jax.nn.dot_product_attention` asked for
    cuDNN on float32 values (which cuDNN refuses: the values become 16-bit only under the
    policy) is traced in its XLA form, which the engine recognises and runs fused again, in the
    compute dtype. (A model that imported the function by name before is not reached.)"""
    del fuse_attention  # (unfused, the XLA form runs as traced, in the policy's dtypes)
    if compute_dtype is None or compute_dtype.itemsize >= 4:
        yield
        return
    original = jax.nn.dot_product_attention

    @functools.wraps(original)
    def traced(query, key, value, *args, implementation=None, **kwargs):
        if implementation == "cudnn" and np.dtype(query.dtype).itemsize >= 4:
            implementation = None
        return original(query, key, value, *args, implementation=implementation, **kwargs)

    jax.nn.dot_product_attention = traced
    try:
        yield
    finally:
        jax.nn.dot_product_attention = original


def is_traceable(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def rewrite(
    fn: Callable,
    compute_dtype,
    compute_for: ComputeFor = _inherit,
    *,
    activations: str = "auto",
    weak_argnums: Sequence[int] = (),
    reduce_dtype=np.float32,
    head_in_fp8: bool = False,
    fuse_attention: AttentionFusion = True,
) -> Callable:
    """Return `fn` with its matmuls and convolutions run in `compute_dtype`.

    Array arguments (and array leaves of pytree arguments) are traced; every other leaf (Python
    numbers, strings, flags) is passed through unchanged, as a static value.

    Args:
      fn: any JAX-traceable function returning a pytree of arrays.
      compute_dtype: dtype of matmul and convolution operands (None leaves them as traced);
        `jamp.fp8.MATMUL_MARKER` (`float8_e4m3fn`) runs layer matmuls in fp8
        (`jamp.fp8.dot_general`: E4M3 forward, E5M2 gradients) and everything else,
        convolutions included, in bfloat16. A layer matmul is one with exactly one operand made
        of the `weak_argnums` arguments alone (the weights): without `weak_argnums` no matmul is
        fp8.
      compute_for: optional per-equation choice of compute dtype (see the module docstring).
      activations: where float32 values between operations live: "float32" (as traced),
        "compute" (in a 16-bit compute dtype where `jamp.activations` allows) or "auto" (float32
        on CPUs, compute elsewhere).
      weak_argnums: positional arguments whose leaves are weak in the sense of
        `jamp.activations` (a model's variables): combined with a 16-bit activation they take its
        dtype instead of promoting it to float32.
      reduce_dtype: the dtype that the gradient of a sharded parameter (see `placing`) leaves its
        16-bit matmul in, and so is summed across devices in.
      fuse_attention: under a 16-bit compute dtype, run each attention recognised in the
        program as one call in that dtype (cuDNN's fused kernel on NVIDIA GPUs, the same
        computation written out elsewhere); False leaves attention as traced; a mapping of
        module path patterns to True / False decides per attention (`AttentionFusion`).
      head_in_fp8: with `compute_dtype` `jamp.fp8.MATMUL_MARKER` (fp8 matmuls, bfloat16 between
        them), whether the function's last matmul (a model's output head) is fp8 as well; by
        default it runs in bfloat16.

    Returns:
      A function with `fn`'s signature and output dtypes.
    """
    options = _Options(
        compute_dtype,
        compute_for,
        activations,
        weak_argnums,
        reduce_dtype,
        head_in_fp8,
        fuse_attention,
    )

    def wrapped(*args, **kwargs):
        return _rewritten(fn, options, args, kwargs)

    return wrapped


@dataclasses.dataclass
class _Options:
    """`rewrite`'s arguments, checked when it is called (a bad one fails there, not at the first
    call of what it returns); `fusion` is `fuse_attention` in the engine's form."""

    compute_dtype: Optional[np.dtype]
    compute_for: ComputeFor
    activations: str
    weak_argnums: Sequence[int]
    reduce_dtype: np.dtype
    head_in_fp8: bool
    fuse_attention: AttentionFusion
    fusion: Union[bool, Callable[[str], bool]] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if self.compute_dtype is not None:
            self.compute_dtype = np.dtype(self.compute_dtype)
        self.reduce_dtype = np.dtype(self.reduce_dtype)
        act.resolve(self.activations)
        self.fusion = attention_fusion(self.fuse_attention)


def _roles(args, count: int, options: _Options) -> tuple[list, list]:
    """Per leaf of `(args, kwargs)` (`count` of them): whether it is weak (a leaf of a
    `weak_argnums` argument), and where it lives on a mesh (`placing`), else None."""
    weak_leaves = [False] * count
    placed_leaves: list[Optional[mixed_ops.Placed]] = [None] * count
    placement_for = _PLACEMENT.get()
    offset = 0
    for i, arg in enumerate(args):
        flat = jax.tree_util.tree_flatten_with_path(arg)[0]
        if i in options.weak_argnums:
            weak_leaves[offset : offset + len(flat)] = [True] * len(flat)
            if placement_for is not None:
                for j, (path, leaf) in enumerate(flat, offset):
                    where = placement_for(tuple(path), tuple(np.shape(leaf)))
                    if where is not None:
                        lives, read = where
                        placed_leaves[j] = mixed_ops.Placed(lives, options.reduce_dtype, read)
        offset += len(flat)
    return weak_leaves, placed_leaves


def _rewritten(fn: Callable, options: _Options, args, kwargs):
    """`fn(*args, **kwargs)`, its traced program evaluated again under `options`."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    traced = [is_traceable(leaf) for leaf in leaves]
    weak_leaves, placed_leaves = _roles(args, len(leaves), options)

    def flat_fn(*arrays):
        it = iter(arrays)
        full = [next(it) if t else leaf for leaf, t in zip(leaves, traced)]
        a, kw = jax.tree.unflatten(treedef, full)
        return fn(*a, **kw)

    arrays = [leaf for leaf, t in zip(leaves, traced) if t]
    calls = scopes.LinenCalls()  # which params path each linen module's scopes stand for
    compute_dtype = options.compute_dtype
    with (
        calls.recording(),
        _cudnn_attention_traced_in_xla_form(compute_dtype, options.fuse_attention),
    ):
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
    form = act.resolve(options.activations)
    act.note(form, compute_dtype)
    if not changes(closed.jaxpr, compute_dtype, Context(options.compute_for, form == "compute")):
        # Nothing to rewrite (e.g. the float32 policy on a float32 model): run it as written,
        # which is bit-identical also where re-evaluating the program eagerly would not be.
        return fn(*args, **kwargs)
    outs = eval_jaxpr(
        closed.jaxpr,
        closed.consts,
        arrays,
        compute_dtype,
        options.compute_for,
        activations=options.activations,
        weak=[w for w, t in zip(weak_leaves, traced) if t],
        placed=[p for p, t in zip(placed_leaves, traced) if t],
        head_in_fp8=options.head_in_fp8,
        fuse_attention=options.fusion,
        calls=calls,
    )
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
