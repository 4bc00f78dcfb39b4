"""jamp.wrap on NNX models nobody here wrote: Google's Tunix LLMs (Llama 3, Qwen 3), unmodified.

Tunix (`google-tunix`, installed with --no-deps by the README's test command: its own dependencies
are its training stack, which its model modules do not import) defines its models with its own
`Einsum`, `Embedder` and `RMSNorm` NNX modules. Its package `__init__` imports that whole stack, so
the model modules are imported here without running it; the models themselves are as published.
"""

import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend import core as jcore

import jamp
from jamp import traced_for


def _import_tunix_models():
    spec = importlib.util.find_spec("tunix")
    if spec is None:
        pytest.skip("google-tunix is not installed (the README's test command installs it)")
    if "tunix" not in sys.modules:  # the package, without its __init__ (see the docstring)
        package = types.ModuleType("tunix")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["tunix"] = package
    from tunix.models.llama3 import model as llama3
    from tunix.models.qwen3 import model as qwen3

    return llama3, qwen3


llama3, qwen3 = _import_tunix_models()

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
B, L, V = 2, 8, 128
TOKENS = jax.random.randint(jax.random.key(0), (B, L), 0, V)
POSITIONS = jnp.broadcast_to(jnp.arange(L), (B, L))
MASK = jnp.tril(jnp.ones((L, L), bool))[None].repeat(B, 0)
SIZES = dict(num_layers=2, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2)


def _build(name):
    if name == "llama3":
        config = llama3.ModelConfig(vocab_size=V, rope_theta=10000, norm_eps=1e-5, **SIZES)
        return llama3.Llama3(config, rngs=nnx.Rngs(0))
    config = qwen3.ModelConfig(vocab_size=V, rope_theta=10000, norm_eps=1e-6, **SIZES)
    return qwen3.Qwen3(config, rngs=nnx.Rngs(0))


NAMES = ("llama3", "qwen3")


def _logits(model):
    logits, _ = model(TOKENS, POSITIONS, None, MASK)
    return logits


def _loss(model):
    logits = _logits(model).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], TOKENS[:, 1:]).mean()


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _walk(sub)


def _grad_eqns(model):
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s: nnx.value_and_grad(_loss)(nnx.merge(graphdef, s)))(state)
    return list(_walk(jaxpr.jaxpr))


def _matmul_dtypes(eqns):
    return [
        tuple(np.dtype(v.aval.dtype) for v in e.invars)
        for e in eqns
        if e.primitive.name == "dot_general"
    ]


@pytest.mark.parametrize("name, compute", [("llama3", BF16), ("llama3", F16), ("qwen3", BF16)])
def test_published_nnx_every_matmul_in_compute_dtype_forward_and_backward(name, compute):
    module = _build(name)
    assert set(_matmul_dtypes(_grad_eqns(module))) == {(F32, F32)}  # as published: fp32
    with traced_for.compiling_for(jax.devices()[0]) as record:
        found = _matmul_dtypes(_grad_eqns(jamp.wrap(module, f"p=f32,c={compute.name},o=f32")))
    assert len(found) >= 3 * 7 and set(found) == {(compute, compute)}
    # Each layer's attention (einsums, a where-mask and a softmax, grouped-query heads) is
    # recognised and runs fused: the written-out form on this CPU, cuDNN's on an NVIDIA target
    # (experiments/gpu_compile.py --part models).
    assert [how for _, how, _ in record.attention] == ["xla"] * SIZES["num_layers"]


@pytest.mark.parametrize("name", NAMES)
def test_published_nnx_same_variables_fp32_output_and_grads(name):
    module = _build(name)
    model = jamp.wrap(module, "mixed_bfloat16")
    ref, got = nnx.state(module), nnx.state(model)
    assert jax.tree.structure(ref) == jax.tree.structure(got)
    jax.tree.map(np.testing.assert_array_equal, ref, got)
    assert _logits(model).dtype == F32
    grads = nnx.jit(nnx.grad(_loss))(model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert {g.dtype for g in leaves} == {F32}
    ref_g = nnx.jit(nnx.grad(_loss))(module)
    flat = [
        jnp.concatenate([g.ravel() for g in jax.tree.leaves(nnx.state(t, nnx.Param))])
        for t in (ref_g, grads)
    ]
    assert float(jnp.linalg.norm(flat[1] - flat[0]) / jnp.linalg.norm(flat[0])) < 3e-2


@pytest.mark.parametrize("name", NAMES)
def test_published_nnx_float32_policy_is_bit_identical(name):
    module = _build(name)
    model = jamp.wrap(module, "float32")
    np.testing.assert_array_equal(_logits(module), _logits(model))
    ref, got = nnx.grad(_loss)(module), nnx.grad(_loss)(model)
    jax.tree.map(
        np.testing.assert_array_equal, nnx.state(ref, nnx.Param), nnx.state(got, nnx.Param)
    )


def test_published_nnx_own_rms_norm_class_runs_in_fp32():
    # Tunix's RMSNorm is its own class; its name marks it as a normalization layer.
    model = jamp.wrap(_build("qwen3"), "mixed_bfloat16", activations="compute")
    graphdef, state = nnx.split(model)
    forward = jax.make_jaxpr(lambda s: _loss(nnx.merge(graphdef, s)))(state).jaxpr
    tagged = [e for e in _walk(forward) if "jamp_policy_" in str(e.source_info.name_stack)]
    assert any(e.primitive.name == "sqrt" for e in tagged)
    # Between matmuls the activations are bf16 here; inside the norm, everything is fp32.
    outs = {np.dtype(v.aval.dtype) for e in tagged for v in e.outvars}
    assert F32 in outs and not outs & {BF16, F16}


def test_published_nnx_fp16_loss_scaled_step_skips_then_learns():
    functional, params, model_state = jamp.nnx.split(jamp.wrap(_build("llama3"), "mixed_float16"))
    tx = optax.adam(3e-3)
    state = jamp.TrainState.create(
        params,
        tx,
        model_state=model_state,
        loss_scale=jamp.DynamicLossScale(2.0**24, growth_interval=50, max_loss_scale=2.0**24),
    )
    step = jax.jit(jamp.make_train_step(functional.loss_fn(lambda m, batch: _loss(m)), tx))
    new, metrics = step(state, TOKENS, jax.random.key(0))
    assert not bool(metrics["grads_finite"])
    jax.tree.map(np.testing.assert_array_equal, state.params, new.params)
    jax.tree.map(np.testing.assert_array_equal, state.opt_state, new.opt_state)
    losses = []
    for _ in range(30):
        new, metrics = step(new, TOKENS, jax.random.key(0))
        losses.append(float(metrics["loss"]))
    assert int(new.skipped_steps) >= 1 and losses[-1] < 0.7 * losses[0]
