"""The rules that step attention's symbolic values (`jamp.engine._attention_values`) through
one operation each (see `jamp.engine._attention`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np

from jamp import jax_compat
from jamp.engine import _attention_forms as F
from jamp.engine._attention_values import (
    MASKED,
    Attn,
    Sym,
    concrete_in_layout,
    few_values,
    in_layout,
    known_form,
    like,
    mask_values,
    one,
    regroup,
    scalar,
    surely,
)

# ---------------------------------------------------------------------------------------------
# The rules: one operation on symbolic values, or None where it is not attention's.


@dataclasses.dataclass
class Engine:
    """What the rules need from the interpreter: evaluate an equation as the engine would
    (inputs real), the compute dtype an equation runs in (None: as traced), the dtype its
    matmul result is carried in, and where to say that a result is one the backward pass keeps
    anyway (a fused kernel's output, which its own backward reads)."""

    evaluate: Callable[[Any, list], list]
    dtype_for: Callable[[Any], Optional[np.dtype]]
    out_dtype: Callable[[Any, np.dtype], np.dtype]
    saved: Callable[[Any, list], None] = lambda x, perm: None  # x = transpose(kept, perm)
    # (source, axis, group) where x = jnp.repeat(source, group, axis), else None
    repeated: Callable[[Any], Optional[tuple]] = lambda x: None


def _free(dims, rank) -> list[int]:
    (c, _), (b, _) = dims
    return [i for i in range(rank) if i not in c and i not in b]


def _softmax_axis(attn: Attn, axis: int) -> bool:
    """Fixes which operand of the first matmul holds the queries from the softmax axis (an
    output axis of that matmul): the keys' only free axis. False if it is no such axis."""
    dims = jax_compat.param(attn.first, "dimension_numbers")
    lhs, rhs = (v.aval for v in attn.first.invars)
    (_, _), (lb, _) = dims
    lf, rf = (
        _free(dims, lhs.ndim),
        _free(((dims[0][1], dims[0][0]), (dims[1][1], dims[1][0])), rhs.ndim),
    )
    nb = len(lb)
    if nb + len(lf) <= axis and len(rf) == 1:
        q_is_lhs = True
    elif nb <= axis < nb + len(lf) and len(lf) == 1:
        q_is_lhs = False
    else:
        return False
    if attn.q_is_lhs not in (None, q_is_lhs):
        return False
    attn.q_is_lhs = q_is_lhs
    return True


def _scaled(sym: Sym, factor) -> Optional[Sym]:
    attn = sym.attn
    assert attn is not None  # the scores'
    if isinstance(factor, float):
        if not factor > 0:
            return None
        attn.scale *= factor
    else:  # a traced scalar: folded into q, where it scales q . k the same
        if attn.masks or attn.hidden:
            return None  # (its sign, which decides whether masked stays masked, is unknown)
        attn.q_factor = factor if attn.q_factor is None else attn.q_factor * factor
    if attn.bias is not None:
        attn.bias = attn.bias * factor
    return like(sym)


def logits_rule(eqn, vals, atoms, scope) -> Optional[list]:
    """An operation on the (scaled, biased, masked) scores."""
    name = eqn.primitive.name
    i = next(j for j, x in enumerate(vals) if isinstance(x, Sym) and x.kind == "logits")
    orig = vals[i]
    attn = dataclasses.replace(  # values may branch
        orig.attn, masks=list(orig.attn.masks), hidden=list(orig.attn.hidden)
    )
    sym = like(orig, attn=attn)
    others = [(x, a) for j, (x, a) in enumerate(zip(vals, atoms)) if j != i]
    if name == "sub" and i == 0 and isinstance(vals[1], Sym) and vals[1].kind == "max":
        if vals[1].src is orig and vals[1].kept:
            return [Sym("shifted", sym.shape, vals[1].attn, sym.perm, vals[1].axis, src=orig)]
    if any(isinstance(x, Sym) and x.kind != "bcast" for x, _ in others):
        return None
    if name in ("convert_element_type", "copy", "copy_p"):
        return [like(sym)]
    if name in ("transpose", "reshape"):
        return _relaid(sym, eqn)
    if name in ("mul", "div") and len(others) == 1:
        if name == "div" and i != 0:
            return None
        return _scaling(sym, others[0], scope, name == "div")
    if name in ("add", "add_any", "sub") and len(others) == 1:
        if name == "sub" and i != 0:
            return None
        return _biased(sym, others[0], scope, -1.0 if name == "sub" else 1.0)
    if name == "select_n" and len(vals) == 3 and i in (1, 2):
        if isinstance(vals[0], Sym) and vals[0].kind != "bcast":
            return None
        if np.dtype(eqn.invars[0].aval.dtype) != np.dtype(bool):
            return None
        return _selected(sym, (vals[0], atoms[0]), (vals[3 - i], atoms[3 - i]), scope, i == 2)
    if name == "reduce_max":
        return _max(sym, orig, eqn)
    return None


def _scaling(sym: Sym, side: tuple[Any, Any], scope, divides: bool) -> Optional[list]:
    """The scores times (or divided by) one number."""
    factor = scalar(*side, scope)
    if factor is None:
        return None
    if divides:
        factor = 1.0 / factor
    return None if _scaled(sym, factor) is None else [like(sym)]


def _biased(sym: Sym, side: tuple[Any, Any], scope, sign: float) -> Optional[list]:
    """`sign` times side value `side` (and its variable) added to the scores: a mask where its
    values are 0 or very negative (known, or whatever the data), else a bias."""
    attn = sym.attn
    assert attn is not None  # the scores'
    known = concrete_in_layout(*side, scope, sym)
    if known is not None:  # a constant bias of 0 and very negative values is a mask
        known = np.asarray(known, np.float32) * sign
        hidden = known <= MASKED
        if (hidden | (known == 0)).all():
            attn.masks.append((None, np.logical_not(hidden)))
            return [like(sym)]
    form = None if known is not None else known_form(*side, scope, sym)
    values = () if form is None else (form.yes, form.no)
    hides = [float(v) * sign <= MASKED for v in values]
    by_form = form is not None and all(h or float(v) == 0 for h, v in zip(hides, values))
    x = in_layout(side[0], sym)
    if x is None:
        return None
    if by_form:  # the same, known by its form (a long sequence's)
        assert form is not None
        keep = x.astype(np.float32) * sign > MASKED  # (used if the form is not read)
        attn.masks.append((keep, F.Split(form.region, not hides[0], not hides[1])))
        return [like(sym)]
    # Where the bias hides the scores whatever the inputs (Hugging Face's causal mask made a
    # bias together with the attention mask it is given): see `_attention_masks.masks`.
    hidden = surely(*side, scope, sym, lambda b: np.asarray(b, np.float32) * sign <= MASKED)
    if hidden is not None:
        attn.hidden.append(hidden)
    x = x.astype(np.float32)
    few = few_values(*side, scope)
    if few is not None and mask_values(few.astype(np.float32) * sign):
        # A bias that is 0 or very negative whatever the data (Hugging Face's, made of the
        # attention mask it is given) is that mask: cuDNN then computes no bias gradient.
        attn.masks.append((x * sign > MASKED, None))
        return [like(sym)]
    x = -x if sign < 0 else x
    attn.bias = x if attn.bias is None else attn.bias + x
    return [like(sym)]


def _selected(
    sym: Sym, pred: tuple[Any, Any], fill: tuple[Any, Any], scope, kept_where: bool
) -> Optional[list]:
    """`where(pred, scores, fill)` (`kept_where`; else `where(pred, fill, scores)`) with a very
    negative `fill`: a mask (each of `pred` and `fill` a value and its variable)."""
    attn = sym.attn
    assert attn is not None  # the scores'
    value = scalar(*fill, scope)
    if not isinstance(value, float) or not value <= MASKED:
        return None
    keep = in_layout(pred[0], sym)
    if keep is None:
        return None
    constant: Any = concrete_in_layout(*pred, scope, sym)
    if constant is None:  # a long sequence's, known by its form
        constant = known_form(*pred, scope, sym)
    if not kept_where:
        keep = jnp.logical_not(keep)
        if isinstance(constant, F.Split):
            constant = F.Split(constant.region, not constant.yes, not constant.no)
        elif constant is not None:
            constant = np.logical_not(constant)
    if constant is None:  # a mask of data and constants: where it hides whatever the data
        hidden = surely(*pred, scope, sym, lambda p: np.asarray(p, bool) != kept_where)
        if hidden is not None:
            attn.hidden.append(hidden)
    attn.masks.append((keep, constant))
    return [like(sym)]


def _max(sym: Sym, orig: Sym, eqn) -> Optional[list]:
    """The maximum over the softmax axis, which fixes which operand holds the queries."""
    assert sym.attn is not None  # the scores'
    axes = jax_compat.param(eqn, "axes")
    (axis,) = axes if len(axes) == 1 else (None,)
    first_axis = None if axis is None else one(sym, axis)
    if first_axis is None or not _softmax_axis(sym.attn, first_axis):
        return None
    return [Sym("max", eqn.outvars[0].aval.shape, sym.attn, sym.perm, first_axis, src=orig)]


def _relaid(sym: Sym, eqn) -> Optional[list]:
    """A transpose or reshape of the scores or the weights: the same values, laid out anew."""
    shape = tuple(eqn.outvars[0].aval.shape)
    if eqn.primitive.name == "transpose":
        perm = jax_compat.param(eqn, "permutation")
        return [like(sym, perm=tuple(sym.perm[p] for p in perm), shape=shape)]
    if jax_compat.param(eqn, "dimensions") is not None:
        return None
    groups = regroup(sym, shape)
    return None if groups is None else [like(sym, perm=groups, shape=shape)]


def _kept_axis(sym: Sym, eqn) -> bool:
    """Whether `eqn` (a broadcast or reshape of a reduction) puts the reduced axis back."""
    src = sym.src
    assert src is not None  # a reduction's
    where = src.perm.index((sym.axis,))
    out = tuple(eqn.outvars[0].aval.shape)
    want = src.shape[:where] + (1,) + src.shape[where + 1 :]
    full = tuple(src.shape)
    if eqn.primitive.name == "reshape":
        return out == want
    dims = tuple(jax_compat.param(eqn, "broadcast_dimensions"))
    return out in (want, full) and dims == tuple(d for d in range(len(out)) if d != where)


def softmax_rule(eqn, vals, atoms, scope) -> Optional[list]:
    """An operation of the softmax over the key axis (`jax.nn.softmax` as traced)."""
    name = eqn.primitive.name
    syms = [x for x in vals if isinstance(x, Sym)]
    sym = syms[0]
    if sym.kind in ("max", "sum") and not sym.kept:
        if name == "max" and len(syms) == 1:  # max(x_max, -inf): the initial value
            other = vals[1] if vals[0] is sym else vals[0]
            value = scalar(other, atoms[vals.index(other)], scope)
            return [like(sym)] if isinstance(value, float) and value <= MASKED else None
        if name in ("broadcast_in_dim", "reshape") and _kept_axis(sym, eqn):
            return [like(sym, kept=True)]
        return None
    if sym.kind in ("max", "sum") and name == "stop_gradient":
        return [like(sym)]
    if sym.kind == "shifted" and name == "exp":
        return [like(sym, kind="exp")]
    if sym.kind == "exp" and name == "reduce_sum":
        axes = tuple(jax_compat.param(eqn, "axes"))
        if axes != (sym.perm.index((sym.axis,)),):
            return None
        return [Sym("sum", eqn.outvars[0].aval.shape, sym.attn, sym.perm, sym.axis, src=sym)]
    if name == "div" and len(syms) == 2 and vals[0].kind == "exp" and vals[1].kind == "sum":
        if vals[1].src is vals[0] and vals[1].kept:
            return [like(vals[0], kind="probs")]
    if sym.kind == "probs" and name in ("convert_element_type", "copy"):
        return [like(sym)]
    if sym.kind == "probs" and name in ("transpose", "reshape"):
        return _relaid(sym, eqn)
    return None
