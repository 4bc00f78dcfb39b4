"""Part 3 of experiments/gpu_compile.py: NNX models on the H200 program, one of them ours and one
that nobody here wrote, each wrapped by jamp against the model's own bfloat16 build.

- jamp's NNX `TransformerLM` (jamp/models/nnx_models.py) at GPT-2 small's shape, built from
  `nnx.MultiHeadAttention`, `nnx.Linear`, `nnx.LayerNorm`, `nnx.Embed`: its own bf16 build is the
  Flax way, `dtype=bfloat16` on every layer (parameters float32; set here on the built layers, as
  the library's model has no precision argument).
- Google Tunix's Llama 3 (NNX, `google-tunix`, as published; Llama 3.2 1B's widths, vocabulary and
  grouped-query heads, 4 of its 16 layers, seq 2048): Tunix has no `dtype` argument, its bf16 build
  is its parameters in bfloat16 (as its checkpoint loader makes them), trained as they are.

Each is compiled three ways: the fp32 model, the fp32 model under `jamp.wrap(model,
"mixed_bfloat16")`, and its own bf16 build; AdamW, the same loss and jamp's train step.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jamp
from jamp.models import nnx_models
from jamp.target import compile_for

GPT2 = dict(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072, max_len=1024)
GPT2_QUICK = dict(num_layers=2, d_model=64, num_heads=4, mlp_dim=128, max_len=64)
LLAMA = dict(
    num_layers=4,
    embed_dim=2048,
    hidden_dim=8192,
    num_heads=32,
    head_dim=64,
    num_kv_heads=8,
    vocab_size=128256,
)
LLAMA_QUICK = dict(
    num_layers=2,
    embed_dim=64,
    hidden_dim=128,
    num_heads=4,
    head_dim=16,
    num_kv_heads=2,
    vocab_size=512,
)
VARIANTS = ("float32", "jamp mixed_bfloat16", "own bf16 build")


def tunix_llama3():
    """Tunix's Llama 3 model module, imported without the package's __init__ (which imports
    Tunix's whole training stack); None when google-tunix is not installed."""
    if "tunix" not in sys.modules:
        spec = importlib.util.find_spec("tunix")
        if spec is None:
            return None
        package = types.ModuleType("tunix")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["tunix"] = package
    from tunix.models.llama3 import model

    return model


def _nnx_lm(variant, quick):
    shape = GPT2_QUICK if quick else GPT2
    model = nnx_models.TransformerLM(512 if quick else 50304, rngs=nnx.Rngs(0), **shape)
    if variant == "own bf16 build":  # what `dtype=jnp.bfloat16` in each layer's constructor sets
        for _, layer in model.iter_modules():
            if hasattr(layer, "dtype"):
                layer.dtype = jnp.bfloat16
    return model, shape["max_len"], lambda m, tokens: m(tokens)


def _llama(variant, quick):
    llama3 = tunix_llama3()
    config = llama3.ModelConfig(
        rope_theta=500_000, norm_eps=1e-5, weight_tying=True, **(LLAMA_QUICK if quick else LLAMA)
    )
    model = llama3.Llama3(config, rngs=nnx.Rngs(0))
    if variant == "own bf16 build":
        graphdef, state = nnx.split(model)
        state = jax.tree.map(
            lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
        )
        model = nnx.merge(graphdef, state)
    length = 64 if quick else 2048

    def call(m, tokens):
        batch, n = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(n), (batch, n))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (batch, n, n))
        return m(tokens, positions, None, mask)[0]

    return model, length, call


MODELS = {
    "jamp NNX TransformerLM (GPT-2 small)": _nnx_lm,
    "Tunix Llama 3 (1B widths, 4 layers)": _llama,
}


def report(name, variant, batch, quick, options=None, target="h200"):
    """The CompileReport of one model's train step (AdamW) at `batch` sequences."""
    model, length, call = MODELS[name](variant, quick)
    if variant == "jamp mixed_bfloat16":
        model = jamp.wrap(model, "mixed_bfloat16")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # rest: the dropout's RNG state
    tx = optax.adamw(1e-3)

    def loss_fn(p, model_state, batch_, rng):
        tokens = batch_["tokens"]
        logits = call(nnx.merge(graphdef, p, rest), tokens[:, :-1]).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return loss, (model_state, {})

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    del model, params  # the compile needs only shapes
    state = jax.eval_shape(lambda p: jamp.TrainState.create(p, tx), abstract)
    step = jax.jit(jamp.make_train_step(loss_fn, tx), donate_argnums=(0,))
    tokens = {"tokens": jax.ShapeDtypeStruct((batch, length + 1), jnp.int32)}
    key = jax.eval_shape(lambda: jax.random.key(0))
    return compile_for(step, state, tokens, key, target=target, compiler_options=options)
