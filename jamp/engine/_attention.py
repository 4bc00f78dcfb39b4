"""Attention recognised in a traced program and run as one call (`jamp.attention.attend`).

What the engine looks for is attention as programs write it, in any layout:
`softmax(q . k * scale + bias, masked) . v` -- two `dot_general`s around a softmax over the key
axis, with scalings, additive biases, `where(mask, logits, very negative)` and transposes between
the first one and the softmax (Flax linen / NNX `dot_product_attention`, the XLA form of
`jax.nn.dot_product_attention`, Hugging Face's and hand-written attention, grouped-query heads
included). Evaluation is lazy from the first matmul on: its result, and what is computed from it,
are kept as symbolic values (`Sym`) while each operation is one that attention is made of; the
second matmul then runs the whole as one fused call. Any other use of an intermediate (attention
dropout multiplying the weights, a returned score matrix, a softmax over the queries) evaluates it
as traced instead, exactly as if nothing had been recognised, and the reason is recorded.

Masks and fills are read from the program: a mask computed from constants alone (a causal mask
built from `iota`) is evaluated while tracing, compressed along the axes it is constant on, and a
lower-triangular one becomes cuDNN's causal mask type instead of a [B, T, S] array. Of a mask or
bias computed from data and constants, what holds whatever the data is read likewise; where it
hides at least the causal half, the attention is causal as well (see `_attention_masks`). Past what is
evaluated whole (a long sequence's mask), a mask built from `iota` comparisons is read by its
form instead (`_attention_forms`), at any length. A causal mask with a sliding window (query i
sees keys i - W .. i) is read as cuDNN's causal mask type with that window.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jamp import attention, jax_compat, traced_for
from jamp.engine import _values as V
from jamp.engine._attention_masks import masks, to_bnts
from jamp.engine._attention_rules import Engine, logits_rule, softmax_rule
from jamp.engine._attention_scope import Scope, candidates
from jamp.engine._attention_values import Attn, Sym, like, real

__all__ = ["Engine", "Fuser", "Sym", "real"]


# ---------------------------------------------------------------------------------------------
# The second matmul: the whole attention as one call.


@dataclasses.dataclass
class _Layout:
    """An attention's two matmuls, axis by axis: the batch (`_b`), contracted (`_c`) and free
    (`_f`) axes of the queries, keys and values (`k_s`: the keys' one free axis;
    `v_batch[j]`: the values' axis for batch axis j); `roles[a]` is what output axis a of the
    first matmul is: ("b", j) its batch axis j, ("q", j) its query axis j, ("s", 0) the key
    axis; `one[a]` the first matmul's output axis that axis a of the weights is, `p_b` and
    `p_free` the weights' batch and free axes in the second matmul, `i` which operand of it the
    weights are."""

    i: int
    q: Any
    k: Any
    q_b: list
    q_c: list
    q_f: list
    k_b: list
    k_c: list
    k_s: int
    v_batch: list
    v_c: list
    v_f: list
    roles: list
    one: list
    p_b: list
    p_free: list


def _layout(eqn, i: int, p: Sym, v) -> Optional[_Layout]:
    """The layout of an attention whose weights `p` (operand `i` of `eqn`) meet the values
    `v`, or None where the second matmul does not contract the key axis with the values."""
    attn = p.attn
    assert attn is not None and attn.q_is_lhs is not None  # the weights'
    (c2, b2) = jax_compat.param(eqn, "dimension_numbers")
    p_c, v_c = (c2[0], c2[1]) if i == 0 else (c2[1], c2[0])
    p_b, v_b = (b2[0], b2[1]) if i == 0 else (b2[1], b2[0])
    (c1, b1) = jax_compat.param(attn.first, "dimension_numbers")
    ql = attn.q_is_lhs
    q, k = (attn.q, attn.k) if ql else (attn.k, attn.q)
    q_c, k_c = (c1[0], c1[1]) if ql else (c1[1], c1[0])
    q_b, k_b = (b1[0], b1[1]) if ql else (b1[1], b1[0])
    q_f = [a for a in range(np.ndim(q)) if a not in q_c and a not in q_b]
    (k_s,) = [a for a in range(np.ndim(k)) if a not in k_c and a not in k_b]
    nb, nq = len(q_b), len(q_f)
    roles = [("b", j) for j in range(nb)]
    queries = [("q", j) for j in range(nq)]
    roles += queries + [("s", 0)] if ql else [("s", 0)] + queries
    if any(len(g) != 1 for g in p.perm):  # an axis of the weights still merged
        return None
    one = [g[0] for g in p.perm]
    if len(p_c) != 1 or roles[one[p_c[0]]] != ("s", 0) or len(p_b) != nb:
        return None
    v_batch = [None] * nb
    for pa, va in zip(p_b, v_b):
        role = roles[one[pa]]
        if role[0] != "b" or v_batch[role[1]] is not None:
            return None
        v_batch[role[1]] = va
    p_free = [a for a in range(len(p.shape)) if a not in p_c and a not in p_b]
    if sorted(roles[one[a]] for a in p_free) != queries or nq == 0:
        return None
    v_f = [a for a in range(np.ndim(v)) if a not in v_c and a not in v_b]
    q_b, q_c, k_b, k_c, v_c, p_b = map(list, (q_b, q_c, k_b, k_c, v_c, p_b))
    return _Layout(
        i, q, k, q_b, q_c, q_f, k_b, k_c, k_s, v_batch, v_c, v_f, roles, one, p_b, p_free
    )


def _grouped(lay: _Layout, k, v, kv_heads: int, engine: Engine):
    """Keys and values repeated over the heads for grouped-query attention, as their sources:
    a fused kernel takes them grouped (query head h reads kv head h // group, as the repeat
    lays out), so the repeated copies are neither written nor kept for the backward."""
    k_rep, v_rep = engine.repeated(k), engine.repeated(v)
    if len(lay.q_b) == 2 and k_rep and v_rep and k_rep[1] == lay.k_b[1]:
        if v_rep[1] == lay.v_batch[1] and k_rep[2] == v_rep[2] and kv_heads % k_rep[2] == 0:
            return k_rep[0], v_rep[0], kv_heads // k_rep[2]
    return k, v, kv_heads


def _canon(x, b_axes, pos, rest, heads):
    """An operand as [B, T, heads, -1] (B: its first batch axis, or 1; T: `pos`)."""
    x = jnp.transpose(x, ([b_axes[0]] if b_axes else []) + [pos] + list(b_axes[1:]) + rest)
    x = x if b_axes else x[None]
    return x.reshape(x.shape[:2] + (heads, -1))


def _bnts_order(lay: _Layout) -> tuple:
    """The first matmul's output axes as `_to_bnts` takes them: (the first batch axis or None,
    the other batch and query axes, the first query axis, the key axis)."""
    pos = {r: a for a, r in enumerate(lay.roles)}
    nb, nq = len(lay.q_b), len(lay.q_f)
    return (
        pos[("b", 0)] if nb else None,
        [pos[("b", j)] for j in range(1, nb)] + [pos[("q", j)] for j in range(1, nq)],
        pos[("q", 0)],
        pos[("s", 0)],
    )


def _as_second_matmul(out, lay: _Layout, q, v, sizes: list):
    """The fused call's [B, T, N, Hv] output in the second matmul's output layout, and the
    permutation that took it there."""
    nb, nq = len(lay.q_b), len(lay.q_f)
    # [B, T, N, Hv] -> [B, T, batch 1.., query 1.., value free..] -> the matmul's output layout
    b_size = [np.shape(q)[lay.q_b[0]]] if nb else [1]
    out = out.reshape(
        b_size
        + [np.shape(q)[lay.q_f[0]]]
        + sizes[1:nb]
        + sizes[nb + 1 :]
        + [np.shape(v)[a] for a in lay.v_f]
    )
    have = [("b", 0), ("q", 0)] + [("b", j) for j in range(1, nb)]
    have += [("q", j) for j in range(1, nq)] + [("v", j) for j in range(len(lay.v_f))]
    if not nb:
        out, have = out[0], have[1:]
    want = [lay.roles[lay.one[a]] for a in lay.p_b]
    p_side = [lay.roles[lay.one[a]] for a in lay.p_free]
    v_side = [("v", j) for j in range(len(lay.v_f))]
    want += p_side + v_side if lay.i == 0 else v_side + p_side
    perm = [have.index(r) for r in want]
    return jnp.transpose(out, perm), perm


def fuse(eqn, vals, engine: Engine, where: str) -> Optional[list]:
    """`eqn`, a `dot_general` of the softmax and the values: the attention as one call."""
    i = 0 if isinstance(vals[0], Sym) else 1
    p, v = vals[i], vals[1 - i]
    if isinstance(v, Sym) or p.kind != "probs" or p.attn.q_is_lhs is None:
        return None
    dtype = engine.dtype_for(eqn)
    if dtype is None or dtype.itemsize >= 4:
        return None
    attn = p.attn
    lay = _layout(eqn, i, p, v)
    if lay is None:
        return None
    q, k = lay.q, lay.k
    if attn.q_factor is not None:
        q = q * attn.q_factor.astype(q.dtype)
    nb = len(lay.q_b)
    sizes = [np.shape(q)[a] for a in lay.q_b] + [np.shape(q)[a] for a in lay.q_f]
    heads = int(np.prod(sizes[1:nb] + sizes[nb + 1 :]))
    k, v, kv_heads = _grouped(lay, k, v, int(np.prod(sizes[1:nb])), engine)
    q4 = _canon(q, lay.q_b, lay.q_f[0], lay.q_f[1:] + lay.q_c, heads)
    k4 = _canon(k, lay.k_b, lay.k_s, lay.k_c, kv_heads)
    v4 = _canon(v, lay.v_batch, lay.v_c[0], lay.v_f, kv_heads)
    order = _bnts_order(lay)
    full = attn.first.outvars[0].aval.shape
    bias = None if attn.bias is None else to_bnts(attn.bias, order, full)
    mask, causal, window = masks(attn, order, full)
    out, how, why = attention.attend(
        q4,
        k4,
        v4,
        bias=bias,
        mask=mask,
        scale=attn.scale,
        causal=causal,
        window=window,
        compute_dtype=dtype,
    )
    out, perm = _as_second_matmul(out, lay, q, v, sizes)
    out = out.astype(engine.out_dtype(eqn, dtype))
    _record(where, how, why)
    if how == "cudnn":  # cuDNN's backward reads its output: the backward pass keeps it anyway
        engine.saved(out, perm)
    return [out]


def _record(where: str, how: str, why: str) -> None:
    record = traced_for.tracing()
    if record is not None:
        record.attention.append((where, how, why))


# ---------------------------------------------------------------------------------------------
# The driver, one per program the engine evaluates.


def _once(fn):
    memo = []

    def call():
        if not memo:
            memo.append(fn())
        return memo[0]

    return call


def _unreachable():
    raise AssertionError("a value inside an attention's sub-program was read outside it")


class Fuser:
    """Recognises the attentions of one program while the engine evaluates it."""

    def __init__(
        self,
        jaxpr,
        consts,
        engine: Engine,
        where: Callable[[Any], str],
        fuses: Optional[Callable[[str], bool]] = None,
    ):
        self.first = candidates(jaxpr)
        self.scope = Scope(jaxpr, consts)
        self.engine = engine
        self.where = where
        self.fuses = fuses  # module path -> whether its attention may be fused (None: all)
        self.unfused: set[int] = set()

    def start(self, eqn, invals, weak) -> Optional[list]:
        """At a candidate first matmul of two activations: its result, symbolically."""
        if id(eqn) not in self.first or any(weak) or any(isinstance(x, Sym) for x in invals):
            return None
        if self.fuses is not None and not self.fuses(self.where(eqn)):
            return None
        dtype = self.engine.dtype_for(eqn)
        if dtype is None or dtype.itemsize >= 4:
            return None
        attn = Attn(eqn, invals[0], invals[1], None, dtype)
        shape = tuple(eqn.outvars[0].aval.shape)
        replay = _once(lambda: self.engine.evaluate(eqn, list(invals))[0])
        return [Sym("logits", shape, attn, tuple((a,) for a in range(len(shape))), replay=replay)]

    def step(self, eqn, invals) -> Optional[list]:
        """An equation with symbolic operands: its symbolic results, or None (then its operands
        are to be computed and it evaluated as traced)."""
        outs = self._rule(eqn, invals, list(eqn.invars), self.scope)
        if outs is None:
            self._note_unfused(eqn, invals)
            return None
        replay = _once(lambda: self.engine.evaluate(eqn, [real(x) for x in invals]))
        return [
            like(o, replay=lambda j=j: replay()[j]) if isinstance(o, Sym) else o
            for j, o in enumerate(outs)
        ]

    def _note_unfused(self, eqn, invals) -> None:
        for x in invals:
            if isinstance(x, Sym) and x.attn is not None and x.attn.q_is_lhs is not None:
                if id(x.attn.first) not in self.unfused:
                    self.unfused.add(id(x.attn.first))
                    what = "the attention weights" if x.kind == "probs" else "the softmax"
                    why = f"a `{eqn.primitive.name}` on {what} (not attention's: dropout?)"
                    _record(self.where(eqn), "unfused", why)

    def _rule(self, eqn, vals, atoms, scope) -> Optional[list]:
        name = eqn.primitive.name
        if eqn.primitive is V.DOT:
            return fuse(eqn, vals, self.engine, self.where(eqn))
        if name in ("jit", "pjit", "closed_call", "custom_jvp_call"):
            return self._body(eqn, vals, atoms, scope)
        if any(isinstance(x, Sym) and x.kind == "logits" for x in vals):
            return logits_rule(eqn, vals, atoms, scope)
        if any(isinstance(x, Sym) and x.kind != "bcast" for x in vals):
            return softmax_rule(eqn, vals, atoms, scope)
        return None

    def _body(self, eqn, vals, atoms, scope) -> Optional[list]:
        """A sub-program without matmuls (`jnp.where`'s, a custom-JVP softmax), interpreted in
        place with the same rules; its other operations run as traced."""
        key = "call_jaxpr" if eqn.primitive.name in ("closed_call", "custom_jvp_call") else "jaxpr"
        closed = jax_compat.param(eqn, key)
        jaxpr, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "jaxpr") else (closed, ())
        if V.has_matmul(jaxpr):
            return None
        inner = Scope(jaxpr, consts, (scope, atoms))
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, vals))

        def read(a):
            return a.val if isinstance(a, jcore.Literal) else env[a]

        for e in jaxpr.eqns:
            ins = [read(a) for a in e.invars]
            if any(isinstance(x, Sym) and x.kind != "bcast" for x in ins):
                outs = self._rule(e, ins, list(e.invars), inner)
                if outs is None:
                    return None
            elif e.primitive.name == "broadcast_in_dim" and len(ins) == 1:
                dims = tuple(int(d) for d in jax_compat.param(e, "broadcast_dimensions"))
                aval = e.outvars[0].aval
                if _is_bcast(ins[0]):  # a broadcast of a broadcast: one, from the first source
                    src = ins[0]
                    outs = [
                        like(src, shape=tuple(aval.shape), dims=tuple(dims[d] for d in src.dims))
                    ]
                    env.update(zip(e.outvars, outs))
                    continue
                outs = [
                    Sym(
                        "bcast",
                        tuple(aval.shape),
                        value=ins[0],
                        dims=dims,
                        scope=inner,
                        atom=e.invars[0],
                        replay=_unreachable,
                    )
                ]
            else:
                real = [_force(x) for x in ins]
                outs = V.bind(e, V.as_traced(e, real), e.params)
            env.update(zip(e.outvars, outs))
        return [_force(read(a)) if _is_bcast(read(a)) else read(a) for a in jaxpr.outvars]


def _is_bcast(x) -> bool:
    return isinstance(x, Sym) and x.kind == "bcast"


def _force(x):
    """A lazy broadcast computed; anything else as it is."""
    if _is_bcast(x):
        return jax.lax.broadcast_in_dim(x.value, x.shape, x.dims)
    return x
