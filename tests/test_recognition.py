"""Recognition never breaks a wrap: the forms third-party models write fuse, a recogniser that
cannot prove its pattern falls back to the plain rewrite with one warning, and fusion can be
turned off per wrap and per module path.

The programs here are written for these tests, after the forms of published models: Gemma's keys
and values repeated with `expand_dims` then `broadcast_to` (or `jnp.repeat`) then a reshape,
Mamba2's state broadcast the same way beside an attention. Before the fix each raised
`IndexError` in the k/v repeat recogniser and no model holding one could be wrapped.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from toy import spy_attend_shapes

import jamp
from jamp import traced_for
from jamp.engine import _attention, _recompute, _repeats, _tail, recompute_widened, rewrite

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
B, T, N, KV, H = 2, 16, 4, 2, 8
_keys = jax.random.split(jax.random.key(0), 3)
Q = jax.random.normal(_keys[0], (B, T, N, H))
K, V = (jax.random.normal(k, (B, T, KV, H)) for k in _keys[1:])


def _attend(q, k, v):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * H**-0.5
    pos = jnp.arange(T)
    scores = jnp.where(pos[:, None] >= pos[None, :], scores, -2.3819763e38)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _broadcast_to_repeat(x):  # Gemma's form: x[..., None, :] broadcast, then merged
    return jnp.broadcast_to(x[:, :, :, None, :], (B, T, KV, N // KV, H)).reshape(B, T, N, H)


def _expand_then_repeat(x):  # expand_dims, jnp.repeat along the new axis, merged
    return jnp.repeat(jnp.expand_dims(x, 3), N // KV, axis=3).reshape(B, T, N, H)


def _with_state(q, k, v):  # Mamba2's form: a state broadcast over groups beside the attention
    state = jnp.broadcast_to(jnp.expand_dims(k[:, :, 0], 2), (B, T, 3, H)).reshape(B, T * 3, H)
    return _attend(q, _expand_then_repeat(k), _expand_then_repeat(v)) + state[:, :T, None, :]


PROGRAMS = {
    "broadcast_to(expand_dims) repeat": lambda q, k, v: _attend(
        q, _broadcast_to_repeat(k), _broadcast_to_repeat(v)
    ),
    "jnp.repeat(expand_dims) repeat": lambda q, k, v: _attend(
        q, _expand_then_repeat(k), _expand_then_repeat(v)
    ),
    "state broadcast beside attention": _with_state,
}


def _run(fn, fuse=True):
    return rewrite(fn, BF16, activations="float32", fuse_attention=fuse)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_composed_broadcasts_fuse_grouped_and_match_the_program_as_traced(name, monkeypatch):
    fn = PROGRAMS[name]
    calls = spy_attend_shapes(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.RecognitionWarning)
        fused = jax.jit(_run(fn))(Q, K, V)
    # One fused call, taking the KV heads as they are (not N repeated copies).
    assert calls == [((B, T, N, H), (B, T, KV, H), (B, T, KV, H))]
    traced = jax.jit(_run(fn, fuse=False))(Q, K, V)
    np.testing.assert_allclose(fused, traced, atol=3e-2, rtol=0)
    np.testing.assert_allclose(fused, fn(Q, K, V), atol=3e-2, rtol=0)
    grads = [
        jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(Q, K, V)
        for f in (_run(fn), _run(fn, fuse=False))
    ]
    for got, want in zip(*grads):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2e-2


def _failing(*args, **kwargs):
    raise IndexError("a form this recogniser cannot read")


@pytest.mark.parametrize(
    "target, name",
    [
        (_attention, "logits_rule"),  # while the scores are being read
        (_attention, "fuse"),  # at the second matmul
        (_attention, "candidates"),  # before the program is evaluated
        (_repeats, "repeat_of"),  # the k/v repeat
    ],
)
def test_a_failing_attention_recogniser_runs_the_attention_as_traced_with_one_warning(
    target, name, monkeypatch
):
    fn = PROGRAMS["jnp.repeat(expand_dims) repeat"]

    def model(q, k, v):
        with jax.named_scope("decoder/attn"):
            return fn(q, k, v)

    monkeypatch.setattr(target, name, _failing)
    with pytest.warns(jamp.RecognitionWarning) as caught:
        got = jax.jit(_run(model))(Q, K, V)
    messages = {str(w.message) for w in caught}
    assert len(messages) == 1, messages
    (message,) = messages
    assert "IndexError" in message and "runs as traced" in message, message
    if name != "candidates":  # (the whole program's recogniser: no module yet)
        assert "decoder/attn" in message, message
    monkeypatch.undo()
    want = jax.jit(_run(model, fuse=False))(Q, K, V)
    if name == "repeat_of":  # fused, with the keys and values repeated as the program has them
        np.testing.assert_allclose(got, want, atol=3e-2, rtol=0)
    else:  # the attention as traced: the same operations as with fusion off
        np.testing.assert_array_equal(got, want)


def test_a_failing_activation_recogniser_runs_the_activation_as_traced(monkeypatch):
    w = jax.random.normal(jax.random.key(1), (64, 512))

    def mlp(x, w):
        with jax.named_scope("mlp"):
            return jax.nn.gelu(x @ w, approximate=True) @ w.T

    x = jax.random.normal(jax.random.key(2), (256, 64))
    want = _run(mlp)(x, w)
    monkeypatch.setattr(_recompute, "regions", _failing)
    with pytest.warns(jamp.RecognitionWarning, match="recomputed in the backward"):
        got = _run(mlp)(x, w)
    np.testing.assert_array_equal(got, want)


def test_a_failing_loss_tail_recogniser_runs_the_loss_as_traced(monkeypatch):
    logits = jax.random.normal(jax.random.key(3), (2, 1024, 1024), BF16)
    labels = jnp.zeros((2, 1024), jnp.int32)

    def loss(x):
        x = x.astype(F32)
        return -jnp.take_along_axis(jax.nn.log_softmax(x), labels[..., None], -1).mean()

    want = jax.grad(recompute_widened(loss))(logits)
    monkeypatch.setattr(_tail, "find_tail", _failing)
    with pytest.warns(jamp.RecognitionWarning, match="the loss"):
        got = jax.grad(recompute_widened(loss))(logits)
    np.testing.assert_array_equal(got.astype(F32), want.astype(F32))


# ---------------------------------------------------------------------------------------------
# The switch: per wrap, per module path.


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((N, H), name=n)(x) for n in ("q", "k", "v"))
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1))(_attend(q, k, v))


class _Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Block(name="cross")(_Block(name="self_attn")(x))


def test_attention_fusion_is_turned_off_per_wrap_and_per_module_path(monkeypatch):
    calls = spy_attend_shapes(monkeypatch)
    x = jax.random.normal(jax.random.key(4), (B, T, 32))
    variables = _Two().init(jax.random.key(5), x)
    runs = {}
    for fuse in (True, False, {"cross": False}, {"*/self_attn": False, "*": True}):
        calls.clear()
        with traced_for.compiling_for(jax.devices()[0]) as record:
            wrapped = jamp.wrap(_Two(), "mixed_bfloat16", fuse_attention=fuse)
            runs[str(fuse)] = wrapped.apply(variables, x)
        runs[str(fuse) + " where"] = [where.split("/")[-1] for where, _, _ in record.attention]
        runs[str(fuse) + " calls"] = len(calls)
    assert runs["True calls"] == 2 and runs["False calls"] == 0
    assert runs["{'cross': False} where"] == ["self_attn"]
    assert runs["{'*/self_attn': False, '*': True} where"] == ["cross"]
    np.testing.assert_allclose(runs["True"], runs["False"], atol=5e-2, rtol=0)


def test_attention_fusion_is_turned_off_for_nnx_and_autocast(monkeypatch):
    calls = spy_attend_shapes(monkeypatch)

    class Attn(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.Linear(32, N * H, rngs=rngs)

        def __call__(self, x):
            q = self.q(x).reshape(B, T, N, H)
            kv = q[:, :, :KV].repeat(N // KV, axis=2)
            return _attend(q, kv, kv)

    x = jax.random.normal(jax.random.key(6), (B, T, 32))
    model = Attn(nnx.Rngs(0))
    jamp.wrap(model, "mixed_bfloat16")(x)
    assert len(calls) == 1
    jamp.wrap(model, "mixed_bfloat16", fuse_attention=False)(x)
    jamp.wrap(model, "mixed_bfloat16", fuse_attention={"*": False})(x)
    jamp.autocast(_attend, "mixed_bfloat16", fuse_attention=False)(Q, Q, Q)
    assert len(calls) == 1
    jamp.autocast(_attend, "mixed_bfloat16")(Q, Q, Q)
    assert len(calls) == 2


@pytest.mark.parametrize("bad", ["no", {"x": "no"}, {1: True}, [("x", 1)]])
def test_a_bad_fusion_switch_is_one_clear_error(bad):
    with pytest.raises(TypeError, match="fuse_attention=.*expected True, False, or a mapping"):
        jamp.wrap(_Two(), "mixed_bfloat16", fuse_attention=bad)


# ---------------------------------------------------------------------------------------------
# A sweep: chained broadcasts, reshapes and transposes on the keys and values around an
# attention; each either fused and equal to the unfused program, or unfused with a warning;
# never an exception.


def _layout_chain(rng: np.random.Generator):
    """A random function [B, T, KV, H] -> [B, T, N, H] made of expand_dims / broadcast_to /
    jnp.repeat / transposes / reshapes, that is a repeat (or a tile) of the KV heads."""
    steps = []
    form = rng.integers(4)
    pre_t = bool(rng.integers(2))  # a transpose pair around it

    def chain(x):
        if pre_t:
            x = jnp.transpose(x, (0, 2, 1, 3))  # [B, KV, T, H]
            x = jnp.transpose(x, (0, 2, 1, 3))
        if form == 0:  # expand_dims, broadcast_to, reshape
            x = jnp.broadcast_to(x[:, :, :, None, :], (B, T, KV, N // KV, H))
        elif form == 1:  # expand_dims twice, broadcast, then two reshapes
            x = jnp.expand_dims(jnp.expand_dims(x, 3), 4)  # [B, T, KV, 1, 1, H]
            x = jnp.broadcast_to(x, (B, T, KV, N // KV, 1, H)).reshape(B, T, KV, N // KV, H)
        elif form == 2:  # jnp.repeat of an expanded axis
            x = jnp.repeat(jnp.expand_dims(x, 3), N // KV, axis=3)
        else:  # a tile (not a repeat: head h reads kv head h % KV)
            x = jnp.broadcast_to(x[:, :, None], (B, T, N // KV, KV, H))
        return x.reshape(B, T, N, H)

    steps.append((form, pre_t))
    return chain, steps


@pytest.mark.parametrize("seed", range(12))
def test_sweep_of_layout_chains_around_an_attention_never_raises(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    chain_k, what_k = _layout_chain(rng)
    chain_v, what_v = _layout_chain(rng)
    transpose_q = bool(rng.integers(2))

    def fn(q, k, v):
        if transpose_q:
            q = jnp.transpose(jnp.transpose(q, (0, 2, 1, 3)), (0, 2, 1, 3))
        return _attend(q, chain_k(k), chain_v(v))

    calls = spy_attend_shapes(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = _run(fn)(Q, K, V)
    warned = [w for w in caught if issubclass(w.category, jamp.RecognitionWarning)]
    np.testing.assert_allclose(fused, fn(Q, K, V), atol=3e-2, rtol=0, err_msg=str(what_k + what_v))
    assert calls or warned, (what_k, what_v)
    traced = _run(fn, fuse=False)(Q, K, V)
    np.testing.assert_allclose(fused, traced, atol=3e-2, rtol=0)
