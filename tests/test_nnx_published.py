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
        pytest.skip(
            "google-tunix is not installed (the README's test command installs it)",
            allow_module_level=True,
        )
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


# ----- fp8 on a published NNX model: the linen fp8 battery on Tunix's Llama 3


def _fp8_setup():
    model = jamp.wrap(_build("llama3"), "mixed_fp8")
    functional, params, model_state = jamp.nnx.split(model)
    # Tunix initialises the MLP's weights to zeros (its models are meant to load a checkpoint):
    # draw them, so that every matmul sees values.
    keys = iter(jax.random.split(jax.random.key(5), len(jax.tree.leaves(params))))
    params = jax.tree.map(
        lambda w: w if jnp.any(w != 0) else 0.05 * jax.random.normal(next(keys), w.shape, w.dtype),
        params,
    )

    def loss(m, batch):
        tokens = batch["tokens"]
        positions = jnp.broadcast_to(jnp.arange(L), tokens.shape)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (tokens.shape[0], L, L))
        logits, _ = m(tokens, positions, None, mask)
        logits = logits.astype(jnp.float32)
        targets = batch["tokens"][:, 1:]
        value = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets).mean()
        return value * jnp.mean(batch["poison"])  # per example, so that a batch splits

    batch = {"tokens": TOKENS, "poison": jnp.ones(B)}
    return functional, params, model_state, functional.loss_fn(loss), batch


def _fp8_state(params, model_state, loss_fn, batch):
    st = jamp.fp8.init_state(loss_fn, params, model_state, batch, jax.random.key(0), history=4)
    return jamp.TrainState.create(params, optax.adam(1e-3), model_state=model_state, fp8_state=st)


def test_published_nnx_fp8_layer_matmuls_are_e4m3_forward_e5m2_backward_each_with_a_site():
    _, params, model_state, loss_fn, batch = _fp8_setup()
    grad = jax.grad(lambda p: loss_fn(p, model_state, batch, jax.random.key(0))[0])
    eqns = list(_walk(jax.make_jaxpr(grad)(params).jaxpr))
    dots = [
        tuple(v.aval.dtype.name for v in e.invars)
        for e in eqns
        if e.primitive.name == "dot_general"
    ]
    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    forward = dots.count((e4, e4))
    # Per layer q, k / v (one einsum for both here), o, gate, up, down read a weight: fp8
    assert forward >= 4 * SIZES["num_layers"]
    assert dots.count((e5, e4)) == dots.count((e4, e5)) == forward  # input and weight gradients
    # Attention's scores and mix and the tied head are bf16; nothing is float32.
    others = [d for d in dots if e4 not in d and e5 not in d]
    assert others and set(others) == {("bfloat16", "bfloat16")}
    st = jamp.fp8.init_state(loss_fn, params, model_state, batch, jax.random.key(0))
    assert len(st.sites) == forward
    # named by the params path, as the NNX model's attributes nest ("layers/0/attn/q_proj")
    assert all(name.startswith("layers/") for name in st.sites), list(st.sites)[:3]


def test_published_nnx_fp8_state_updates_skips_bit_identically_and_checkpoints(tmp_path):
    from jamp.train.checkpoint import Checkpointer

    _, params, model_state, loss_fn, batch = _fp8_setup()
    state = _fp8_state(params, model_state, loss_fn, batch)
    step = jax.jit(jamp.make_train_step(loss_fn, optax.adam(1e-3)))
    state, metrics = step(state, batch, jax.random.key(1))
    assert bool(metrics["grads_finite"])
    for site in state.fp8_state.sites.values():  # every site recorded x, w and g
        assert np.all(np.asarray(site.amax_history[:, 0]) > 0)
        assert not np.any(np.asarray(site.amax_history[:, 1:]))
    before = jax.device_get(state.fp8_state)
    poisoned = {**batch, "poison": jnp.full(B, np.inf)}
    state, metrics = step(state, poisoned, jax.random.key(1))
    assert not bool(metrics["grads_finite"])
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(state.fp8_state))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, state)
        fresh = state.replace(fp8_state=jax.tree.map(jnp.zeros_like, state.fp8_state))
        restored = ckpt.restore(fresh)
    assert list(restored.fp8_state.sites) == list(state.fp8_state.sites)
    for a, b in zip(jax.tree.leaves(restored.fp8_state), jax.tree.leaves(state.fp8_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)


def test_published_nnx_fp8_state_agrees_single_device_pmap_and_sharded():
    from jamp import parallel, sharding

    _, params, model_state, loss_fn, batch = _fp8_setup()
    tokens = jax.random.randint(jax.random.key(3), (8, L), 0, V)  # one example per device
    big = {"tokens": tokens, "poison": jnp.ones(8)}
    one = jax.jit(jamp.make_train_step(loss_fn, optax.adam(1e-3)))
    # From a state with a history, so every site quantises with the state's scales.
    start, _ = one(_fp8_state(params, model_state, loss_fn, batch), batch, jax.random.key(1))
    start = jax.device_get(start)
    want, _ = one(start, big, jax.random.key(1))

    mesh = sharding.make_mesh("data=2,fsdp=4")
    placed = sharding.shard_state(start, mesh)
    sharded = sharding.make_sharded_train_step(
        jamp.make_train_step(loss_fn, optax.adam(1e-3)), mesh, sharding.state_shardings(placed)
    )
    got, _ = sharded(placed, sharding.shard_batch(big, mesh), jax.random.key(1))
    for a, b in zip(jax.tree.leaves(got.fp8_state), jax.tree.leaves(want.fp8_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)

    # pmap: every replica holds the same state; activations' and weights' amaxes are the batch's
    # (the max over replicas). (The gradients' are each replica's own: within 20 % of n times
    # the single device's here, not equal as for jamp's own Transformer in tests/test_fp8.py.)
    n = jax.local_device_count()
    p_step = parallel.make_p_train_step(
        jamp.make_train_step(loss_fn, optax.adam(1e-3), axis_name=parallel.AXIS_NAME)
    )
    replicas, _ = p_step(parallel.replicate(start), parallel.shard(big), jax.random.key(1))
    for leaf in jax.tree.leaves(jax.device_get(replicas.fp8_state)):
        assert all(np.array_equal(leaf[0], leaf[i]) for i in range(n))
    got_p = parallel.unreplicate(replicas).fp8_state
    for name, site in want.fp8_state.sites.items():
        got_rows = np.asarray(got_p.sites[name].amax_history[:2, 0])
        # (a replica's forward on its one example rounds a little differently in bf16: 1e-4)
        np.testing.assert_allclose(got_rows, np.asarray(site.amax_history[:2, 0]), rtol=1e-3)
