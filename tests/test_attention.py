"""Attention under a 16-bit policy: recognised in the traced program and run as one call.

On this CPU the call is the written-out form (`jamp.attention`), so each test compares it with
the program as traced (the engine with `fuse_attention=False`): the recognition (layouts, scale,
biases, masks, grouped heads) is what is checked here; that the call is cuDNN's fused kernel on
an NVIDIA GPU is checked on the H200 program (tests/test_target.py).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from toy import spy_attend_shapes

import jamp
from jamp import attention, traced_for
from jamp.engine import rewrite
from jamp.models import TransformerLM

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
B, T, N, H = 2, 16, 4, 8
_keys = jax.random.split(jax.random.key(0), 3)
Q, K, V = (jax.random.normal(k, (B, T, N, H)) for k in _keys)
CAUSAL = nn.make_causal_mask(jnp.ones((B, T)))
LENGTHS = jnp.array([T, T - 5])


def _padding_bias(lengths=LENGTHS):
    keep = jnp.arange(T)[None, :] < lengths[:, None]  # which keys are padding
    fill = jnp.full((B, 1, 1, T), jnp.finfo(jnp.float32).min)
    return jax.lax.select(keep[:, None, None, :], jnp.zeros((B, 1, 1, T)), fill)


def _hand_written(q, k, v):
    """Llama-style: einsum, a Python-float scale, an iota causal mask, jax.nn.softmax."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * H**-0.5
    pos = jnp.arange(T)
    scores = jnp.where(pos[:, None] >= pos[None, :], scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _grouped_reshaped(q, k, v):
    """Tunix's Llama 3: q heads grouped per kv head, the scores reshaped to heads and back."""
    kv = 2
    qg = q.reshape(B, T, kv, N // kv, H)
    k, v = k[:, :, :kv], v[:, :, :kv]
    scores = jnp.einsum("BTHGD,BSHD->BHGTS", qg, k) * H**-0.5
    scores = scores.reshape(B, N, T, T)
    scores = jnp.where(CAUSAL, scores, -2.3819763e38)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).reshape(B, kv, N // kv, T, T)
    return jnp.einsum("BHGTS,BSHD->BTHGD", probs, v).reshape(B, T, N, H)


def _repeated(q, k, v):
    """Grouped-query attention written with the keys and values repeated over the heads (Hugging
    Face's `repeat_kv`, MaxText's and many Llama ports' form)."""
    kv = 2
    k, v = (jnp.repeat(x[:, :, :kv], N // kv, axis=2) for x in (k, v))
    return _hand_written(q, k, v)


FORMS = {
    "linen causal mask": lambda q, k, v: nn.dot_product_attention(q, k, v, mask=CAUSAL),
    "linen padding bias": lambda q, k, v: nn.dot_product_attention(q, k, v, bias=_padding_bias()),
    "nnx is_causal": lambda q, k, v: nnx.dot_product_attention(q, k, v, is_causal=True),
    "jax.nn grouped causal": lambda q, k, v: jax.nn.dot_product_attention(
        q, k[:, :, :2], v[:, :, :2], is_causal=True
    ),
    "jax.nn cudnn asked, traced in fp32": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=CAUSAL.astype(bool), implementation="cudnn"
    ),
    "hand-written": _hand_written,
    "grouped heads reshaped": _grouped_reshaped,
    "grouped heads repeated": _repeated,
}


def _run(fn, compute, fuse=True):
    return rewrite(fn, compute, activations="float32", fuse_attention=fuse)


@pytest.mark.parametrize("compute", [BF16, F16])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_attention_forms_fuse_and_match_the_form_as_traced(form, compute):
    fn = FORMS[form]
    with traced_for.compiling_for(jax.devices()[0]) as record:
        fused = _run(fn, compute)(Q, K, V)
    assert [how for _, how, _ in record.attention] == ["xla"], record.attention
    assert "not an NVIDIA GPU" in record.attention[0][2]
    traced = _run(fn, compute, fuse=False)(Q, K, V)
    # (cuDNN refuses float32 values: that form's float32 reference is JAX's XLA form.)
    if "cudnn" in form:
        ref = jax.nn.dot_product_attention(Q, K, V, mask=CAUSAL.astype(bool))
    else:
        ref = fn(Q, K, V)
    assert fused.dtype == ref.dtype == F32
    # Within a 16-bit rounding of the form as traced, both near float32.
    np.testing.assert_allclose(fused, traced, atol=3e-2, rtol=0)
    np.testing.assert_allclose(fused, ref, atol=3e-2, rtol=0)

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(f(*a) * ref), argnums=(0, 1, 2))(Q, K, V)

    for got, want in zip(grads(_run(fn, compute)), grads(_run(fn, compute, fuse=False))):
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert err < 2e-2, (form, err)


def _spy_attend_options(monkeypatch):
    """The keyword arguments (bias, mask, scale, causal, ...) of every `attention.attend` call."""
    calls = []
    original = attention.attend

    def spy(q, k, v, **kw):
        calls.append(kw)
        return original(q, k, v, **kw)

    monkeypatch.setattr(attention, "attend", spy)
    return calls


def test_attention_reads_constant_causal_masks_as_causal_and_keeps_data_masks(monkeypatch):
    calls = _spy_attend_options(monkeypatch)
    _run(FORMS["linen causal mask"], BF16)(Q, K, V)
    _run(FORMS["hand-written"], BF16)(Q, K, V)
    assert [(c["causal"], c["mask"], c["bias"]) for c in calls] == [(True, None, None)] * 2
    calls.clear()
    padded = lambda q, k, v, n: nn.dot_product_attention(q, k, v, bias=_padding_bias(n))  # noqa: E731
    _run(padded, BF16)(Q, K, V, LENGTHS)  # the lengths are data
    (call,) = calls
    # 0 or the most negative float whatever the lengths: a mask (no bias gradient in cuDNN),
    # small: broadcast over heads and queries
    assert not call["causal"] and call["bias"] is None
    assert call["mask"].shape == (B, 1, 1, T)
    calls.clear()
    _run(FORMS["linen padding bias"], BF16)(Q, K, V)  # constant lengths: a bias of 0 or min
    (call,) = calls
    assert call["bias"] is None and call["mask"].shape == (B, 1, 1, T)
    calls.clear()
    data_mask = jnp.arange(T)[None, None, None, :] < LENGTHS[:, None, None, None]
    _run(lambda q, k, v, m: nn.dot_product_attention(q, k, v, mask=m), BF16)(Q, K, V, data_mask)
    (call,) = calls
    assert not call["causal"] and call["mask"].shape == (B, 1, 1, T)
    assert call["scale"] == 1.0  # Flax scales the queries itself


def _hf_causal_bias(q, k, v, attention_mask=None):
    """Hugging Face's Flax GPT-2: its causal mask and the attention mask it is given (all ones
    when none is), combined, broadcast over the batch and made an additive bias of 0 or min."""
    causal = nn.make_causal_mask(jnp.ones((1, T), bool), dtype=bool)
    causal = jnp.broadcast_to(causal, (B, 1, T, T))
    given = jnp.ones((B, T), jnp.int32) if attention_mask is None else attention_mask
    given = jnp.broadcast_to(given[:, None, None, :], causal.shape)
    mask = nn.combine_masks(given, causal)
    bias = jax.lax.select(
        mask > 0, jnp.zeros(mask.shape), jnp.full(mask.shape, jnp.finfo(jnp.float32).min)
    )
    return nn.dot_product_attention(q, k, v, bias=bias)


def test_attention_reads_constant_masks_of_any_batch_size_compressed(monkeypatch):
    """A constant mask is read while tracing on values compressed along the axes they are
    constant on: a causal mask broadcast over a batch larger than what is evaluated whole (here
    T x T elements; GPT-2 small's step at batch 32: 33.5M > 16.8M, which ran cuDNN unmasked at twice
    the FLOPs, with a [32, 1, 1024, 1024] bias) is still cuDNN's causal mask type, and so is a
    constant bias of 0 and the most negative float (Hugging Face's form)."""
    from jamp.engine import _attention_scope

    monkeypatch.setattr(_attention_scope, "_MAX_CONCRETE", T * T)  # the batch's is B times that
    calls = _spy_attend_options(monkeypatch)
    batch_causal = lambda q, k, v: nn.dot_product_attention(  # noqa: E731
        q, k, v, mask=nn.make_causal_mask(jnp.ones((B, T)))
    )
    for fn in (batch_causal, _hf_causal_bias, FORMS["hand-written"]):
        got = _run(fn, BF16)(Q, K, V)
        want = _run(fn, BF16, fuse=False)(Q, K, V)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2
        )
    assert [(c["causal"], c["mask"], c["bias"]) for c in calls] == [(True, None, None)] * 3


def test_long_sequence_masks_are_read_by_their_form_not_evaluated(monkeypatch):
    """Past what is evaluated whole, a mask built from `iota` is read by its form (see
    `jamp.engine._attention_forms`): causal at 65,536 positions, traced in well under a second
    (evaluated, it exhausted a 24 GiB host there; past 4096 x 4096 it was a mask array, every
    score computed). A form that is no mask type (a cache's offset, a strict inequality) stays
    the mask the program computes, with the same outputs."""
    from jamp.engine import _attention_scope

    long = 65536
    calls = _spy_attend_options(monkeypatch)
    pos = lambda: jnp.arange(long)  # noqa: E731

    def hand(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(pos()[:, None] >= pos()[None, :], s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    def hf(q, k, v, attention_mask):
        causal = nn.make_causal_mask(jnp.ones((1, long), bool), dtype=bool)
        given = jnp.broadcast_to(attention_mask[:, None, None, :], (1, 1, long, long))
        mask = nn.combine_masks(given, jnp.broadcast_to(causal, (1, 1, long, long)))
        fill = jnp.full(mask.shape, jnp.finfo(jnp.float32).min)
        return nn.dot_product_attention(q, k, v, bias=jax.lax.select(mask > 0, 0 * fill, fill))

    def linen(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((1, long))))

    def window(q, k, v):
        near = pos()[:, None] - pos()[None, :] < 4096
        mask = nn.combine_masks(nn.make_causal_mask(q[..., 0, 0]), near[None, None])
        return nn.dot_product_attention(q, k, v, mask=mask)

    x = jax.ShapeDtypeStruct((1, long, 2, 8), jnp.float32)
    data = jax.ShapeDtypeStruct((1, long), jnp.int32)
    for fn, args in (
        (hand, (x,) * 3),
        (linen, (x,) * 3),
        (hf, (x,) * 3 + (data,)),
        (window, (x,) * 3),
    ):
        jax.make_jaxpr(_run(fn, BF16))(*args)
    masks = [(c["causal"], c["mask"] is None, c["window"]) for c in calls]
    assert masks == [
        (True, True, None),
        (True, True, None),
        (True, False, None),
        (True, True, 4095),
    ]
    assert [c["bias"] for c in calls] == [None] * 4
    assert calls[2]["mask"].shape == (1, 1, long, long)  # the data's, as the program computes it
    calls.clear()

    monkeypatch.setattr(_attention_scope, "_MAX_CONCRETE", 4)  # these masks known by form only
    masks = {
        "causal": lambda t, s: jnp.arange(t)[:, None] >= jnp.arange(s)[None, :],
        "a cache's offset": lambda t, s: jnp.arange(t)[:, None] + (s - t) >= jnp.arange(s)[None, :],
        "strictly below": lambda t, s: jnp.arange(t)[:, None] > jnp.arange(s)[None, :],
    }
    for name, make in masks.items():
        fn = lambda q, k, v, make=make: nn.dot_product_attention(  # noqa: E731
            q, k, v, mask=make(q.shape[1], k.shape[1])[None, None]
        )
        keys = jnp.concatenate([K, K[:, :4]], axis=1)  # more keys than queries
        got = _run(fn, BF16)(Q, keys, keys)
        want = _run(fn, BF16, fuse=False)(Q, keys, keys)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, err_msg=name
        )
    assert [(c["causal"], c["mask"] is None) for c in calls] == [
        (True, True),
        (False, False),
        (False, False),
    ]


def test_sliding_window_masks_run_as_a_causal_mask_with_a_window(monkeypatch):
    """A causal mask with a sliding window (query i sees keys i - W .. i: Mistral's, Gemma's
    local layers) as one mask, as two masks applied in turn, as `jax.nn`'s own
    `local_window_size`, constant arrays or known by their form only: cuDNN's causal mask type
    with its window (it skips the scores outside), no mask array, the same outputs."""
    from jamp.engine import _attention_scope

    w = 5

    def one_mask(q, k, v):
        pos = jnp.arange(T)
        near = pos[:, None] - pos[None, :] <= w
        return nn.dot_product_attention(q, k, v, mask=(pos[:, None] >= pos[None, :]) & near)

    def in_turn(q, k, v):
        pos = jnp.arange(T)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(pos[:, None] >= pos[None, :], s, -1e30)
        s = jnp.where(pos[:, None] - w <= pos[None, :], s, -1e30)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    def jax_nn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(w, 0))

    for cap in (None, 4):  # evaluated whole; known by form only (as a long sequence's)
        if cap is not None:
            monkeypatch.setattr(_attention_scope, "_MAX_CONCRETE", cap)
        calls = _spy_attend_options(monkeypatch)
        for fn in (one_mask, in_turn, jax_nn):
            got = _run(fn, BF16)(Q, K, V)
            want = _run(fn, BF16, fuse=False)(Q, K, V)
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2
            )
        got = [(c["causal"], c["window"], c["mask"], c["bias"]) for c in calls]
        assert got == [(True, w, None, None)] * 3, (cap, got)


def test_attention_is_causal_where_masks_of_data_hide_at_least_the_causal_half(monkeypatch):
    """A causal mask combined with a mask of data (padding), as one boolean mask (Flax's
    combine_masks) or as one additive bias (Hugging Face's GPT-2, given its attention mask): the
    data mask stays, and cuDNN's causal mask type skips the half of the scores it hides."""
    calls = _spy_attend_options(monkeypatch)

    def combined(q, k, v, attention_mask):
        padding = attention_mask[:, None, None, :] > 0
        mask = nn.combine_masks(nn.make_causal_mask(jnp.ones((B, T))), padding)
        return nn.dot_product_attention(q, k, v, mask=mask)

    given = (jnp.arange(T)[None, :] < LENGTHS[:, None]).astype(jnp.int32)  # right padding
    for fn in (combined, _hf_causal_bias):
        got = _run(fn, BF16)(Q, K, V, given)
        want = _run(fn, BF16, fuse=False)(Q, K, V, given)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2
        )
    (flax, hf) = calls
    assert flax["causal"] and flax["mask"] is not None and flax["bias"] is None
    # Hugging Face's bias is 0 or the most negative float whatever the data: a mask
    assert hf["causal"] and hf["mask"] is not None and hf["bias"] is None
    calls.clear()
    data_only = lambda q, k, v, m: nn.dot_product_attention(q, k, v, mask=m[:, None, None, :] > 0)  # noqa: E731
    _run(data_only, BF16)(Q, K, V, given)
    assert not calls[0]["causal"]  # padding alone hides no causal half


def test_attention_takes_repeated_keys_and_values_grouped(monkeypatch):
    calls = spy_attend_shapes(monkeypatch)
    _run(_repeated, BF16)(Q, K, V)
    assert calls == [((B, T, N, H), (B, T, 2, H), (B, T, 2, H))]  # 2 kv heads, not N copies
    calls.clear()
    # Repeated over another axis than the heads, or not a repeat (a tile): taken as they are.
    _run(lambda q, k, v: _hand_written(q, jnp.tile(k[:, :, :2], (1, 1, 2, 1)), v), BF16)(Q, K, V)
    assert calls == [((B, T, N, H), (B, T, N, H), (B, T, N, H))]


def test_llama_attention_is_grouped_in_every_layer(monkeypatch):
    from jamp.models.llama import LlamaLM

    calls = spy_attend_shapes(monkeypatch)
    model = LlamaLM(
        vocab_size=64, num_layers=3, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=16
    )
    tokens = jnp.arange(32).reshape(2, 16) % 64
    variables = model.init(jax.random.key(0), tokens)
    jamp.wrap(model, "mixed_bfloat16").apply(variables, tokens)
    assert calls == [((2, 16, 4, 8), (2, 16, 2, 8), (2, 16, 2, 8))] * 3


def test_attention_dropout_stays_as_traced_and_says_why():
    def with_dropout(q, k, v):
        return nn.dot_product_attention(
            q, k, v, dropout_rng=jax.random.key(1), dropout_rate=0.1, deterministic=False
        )

    with traced_for.compiling_for(jax.devices()[0]) as record:
        got = _run(with_dropout, BF16)(Q, K, V)
    ((_, how, why),) = record.attention
    assert how == "unfused" and "mul" in why and "attention weights" in why
    np.testing.assert_allclose(got, _run(with_dropout, BF16, fuse=False)(Q, K, V), atol=1e-6)


def test_attention_kept_in_float32_by_an_override_stays_float32_and_unfused():
    model = TransformerLM(vocab_size=32, num_layers=1, d_model=32, num_heads=2, mlp_dim=64)
    tokens = jnp.zeros((2, 8), jnp.int32)
    variables = model.init(jax.random.key(0), tokens)
    override = {nn.MultiHeadDotProductAttention: "float32"}
    with traced_for.compiling_for(jax.devices()[0]) as record:
        wrapped = jamp.wrap(model, "mixed_bfloat16", override, activations="compute")
        jaxpr = jax.make_jaxpr(lambda v: wrapped.apply(v, tokens))(variables).jaxpr
    assert record.attention == []
    batched = [
        e
        for e in jaxpr.eqns
        if e.primitive.name == "dot_general" and jax.tree.leaves(e.params["dimension_numbers"][1])
    ]
    assert batched and all(e.invars[0].aval.dtype == F32 for e in batched)
    # Without the override the same attention is one call.
    with traced_for.compiling_for(jax.devices()[0]) as record:
        wrapped = jamp.wrap(model, "mixed_bfloat16", activations="compute")
        jax.make_jaxpr(lambda v: wrapped.apply(v, tokens))(variables)
    assert [how for _, how, _ in record.attention] == ["xla"]
    assert record.attention[0][0].endswith("DecoderBlock_0/MultiHeadDotProductAttention_0")


def test_attend_written_out_matches_jax_reference():
    q, k, v = (x.astype(BF16) for x in (Q, K[:, :, :2], V[:, :, :2]))
    out, how, _ = attention.attend(q, k, v, scale=0.3, causal=True, compute_dtype=BF16)
    want = jax.nn.dot_product_attention(
        q.astype(F32), k.astype(F32), v.astype(F32), scale=0.3, is_causal=True
    )
    assert how == "xla" and out.dtype == BF16 and out.shape == (B, T, N, H)
    np.testing.assert_allclose(out.astype(F32), want, atol=3e-2)


def test_what_is_known_of_a_value_of_data_and_constants_whatever_the_data():
    """`Scope.partial`: an `and` with a constant False, an `or` with a constant True and a
    `select` whose known predicate picks a constant are known wherever the data are not; other
    operations are known where all their operands are; values come compressed."""
    from jamp.engine._attention_scope import Scope

    upper = ~np.tril(np.ones((4, 4), bool))

    def fn(data):  # data: bool [2, 4]
        padding = jnp.broadcast_to(data[:, None, :], (2, 4, 4))
        causal = jnp.broadcast_to(jnp.asarray(~upper), (2, 4, 4))
        both = jnp.logical_and(padding, causal)
        either = jnp.logical_or(padding, jnp.asarray(upper))
        bias = jax.lax.select(both, jnp.zeros((2, 4, 4)), jnp.full((2, 4, 4), -1e30))
        return both, either, bias, padding.astype(jnp.float32) + 1.0

    closed = jax.make_jaxpr(fn)(jnp.ones((2, 4), bool))
    scope = Scope(closed.jaxpr, closed.consts)
    both, either, bias, other = (scope.partial(v) for v in closed.jaxpr.outvars)
    values, known = both
    assert known.shape == (1, 4, 4) and (known == upper).all()
    assert not np.broadcast_to(values, known.shape)[known].any()
    values, known = either
    assert (known == upper).all() and np.broadcast_to(values, known.shape)[known].all()
    values, known = bias
    assert (known == upper).all()
    assert (np.broadcast_to(values, known.shape)[known] == np.float32(-1e30)).all()
    assert other is None  # data everywhere: nothing known
    assert scope.concrete(closed.jaxpr.outvars[0]) is None
