"""The GPT-2-small train steps that the GPU experiments compile and time, built one way for all.

Each variant is one train step of one network at one precision, with AdamW (lr 1e-4) and the
next-token loss written as users write it (`optax.softmax_cross_entropy_with_integer_labels` on
the logits cast to float32):

  lm_fp32           jamp's TransformerLM (12 x 768, 12 heads, vocab 50304), float32 (TF32 on a
                    GPU: JAX's default precision), a plain value_and_grad + optax step
  lm_jamp_bf16      the same model, jamp.wrap(model, "mixed_bfloat16") + jamp.make_train_step
  lm_jamp_bf16_losses
                    the same with jamp.losses' cross-entropy (no float32 copy of the logits)
  lm_jamp_bf16_chunked  the same with jamp.losses.fused_linear_cross_entropy (the head applied
                    by the loss in chunks of positions: no logits formed)
  lm_jamp_bf16_onehot
                    the same with the loss on one-hot labels (`optax.softmax_cross_entropy`, as
                    Hugging Face's Flax language-modelling example writes it)
  lm_jamp_bf16_sliced, hf_jamp_bf16_sliced
                    the same with the logits shifted instead of the inputs: the model reads all
                    the batch's tokens, `logits[:, :-1]` against `tokens[:, 1:]`, integer labels
  lm_jamp_bf16_hfloss, hf_jamp_bf16_sliced, hf_jamp_bf16_hfloss
                    the loss exactly as Hugging Face's Flax recipe (run_clm_flax) writes it:
                    logits shifted, `optax.softmax_cross_entropy` on `onehot(labels)`
  lm_jamp_f16       jamp.wrap(model, "mixed_float16") + make_train_step, dynamic loss scale
  lm_jamp_fp8       jamp.wrap(model, "mixed_fp8") + make_train_step, delayed scaling (history 16)
  lm_hand_bf16      the same network written by hand in bf16 Flax (peers_flax.HandLM) with
                    jax.nn.dot_product_attention(implementation="cudnn"), a plain step
  hf_fp32           Hugging Face's Flax GPT-2 (transformers < 5), float32, a plain step
  hf_bf16           Hugging Face's own dtype=bfloat16 build, a plain step
  hf_jamp_bf16      jamp.wrap(Hugging Face's float32 model, "mixed_bfloat16") + make_train_step
  lm_plain_bf16, hf_plain_bf16, llama_plain_bf16
                    the wrapped model under a plain value_and_grad + optax step: what
                    make_train_step's own work is counted against
  llama_jamp_bf16   jamp's LlamaLM (12 x 768, 12 heads, 4 kv heads, MLP 2048, vocab 32000) wrapped

`build(name, batch, quick)` gives the jitted step, a function making its concrete arguments, and
their abstract shapes (for `jamp.compile_for` on a machine without the GPU). `quick` shrinks the
shapes for a CPU dry run. The hf_* variants need transformers < 5 (the last with Flax classes).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from peers_flax import HandLM, cudnn_attention  # noqa: E402

import jamp  # noqa: E402
from jamp.models.llama import LlamaLM  # noqa: E402
from jamp.models.transformer import TransformerLM  # noqa: E402

GPT2 = dict(layers=12, d=768, heads=12, mlp=3072, seq=1024, vocab=50304)
QUICK = dict(layers=2, d=64, heads=4, mlp=256, seq=64, vocab=512)
VARIANTS = (
    "lm_fp32",
    "lm_jamp_bf16",
    "lm_jamp_bf16_losses",
    "lm_jamp_bf16_chunked",
    "lm_jamp_bf16_onehot",
    "lm_jamp_bf16_sliced",
    "lm_jamp_bf16_hfloss",
    "lm_jamp_f16",
    "lm_jamp_fp8",
    "lm_hand_bf16",
    "lm_plain_bf16",
    "hf_fp32",
    "hf_bf16",
    "hf_jamp_bf16",
    "hf_jamp_bf16_sliced",
    "hf_jamp_bf16_hfloss",
    "hf_plain_bf16",
    "llama_jamp_bf16",
    "llama_plain_bf16",
)
LR = 1e-4
#: The jamp variants' policies, by the name's second part.
POLICIES = {"jamp_bf16": "mixed_bfloat16", "jamp_f16": "mixed_float16", "jamp_fp8": "mixed_fp8"}


@dataclasses.dataclass
class Built:
    """A variant's jitted step `step(*args)`, `make_args()` for its concrete arguments, their
    abstract shapes, and the model FLOPs of one step (PaLM's count, for MFU)."""

    name: str
    step: Callable
    make_args: Callable[[], tuple]
    abstract_args: tuple
    model_flops: float
    params: int


def hf_config(shape: dict, **extra):
    """Hugging Face's GPT2Config of a shape (the Flax and the PyTorch models take the same)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=shape["vocab"],
        n_positions=shape["seq"],
        n_embd=shape["d"],
        n_layer=shape["layers"],
        n_head=shape["heads"],
        n_inner=shape["mlp"],
        **extra,
    )


def _model(family: str, shape, dtype=jnp.float32):
    if family == "hf":
        from transformers import FlaxGPT2LMHeadModel

        config = hf_config(shape)
        return FlaxGPT2LMHeadModel(config, input_shape=(1, 8), dtype=dtype, _do_init=False).module
    common = dict(num_layers=shape["layers"], d_model=shape["d"], num_heads=shape["heads"])
    common["max_len"] = shape["seq"]
    if family == "lm":
        return TransformerLM(vocab_size=shape["vocab"], mlp_dim=shape["mlp"], **common)
    if family == "hand":
        return HandLM(
            vocab_size=shape["vocab"],
            dtype=dtype,
            mlp_dim=shape["mlp"],
            attention_fn=cudnn_attention,
            **common,
        )
    if family == "llama":  # 4 kv heads of 12; an MLP of 2/3 the width (SwiGLU has three)
        return LlamaLM(
            vocab_size=min(shape["vocab"], 32000),
            num_kv_heads=max(1, shape["heads"] // 3),
            mlp_dim=shape["mlp"] * 2 // 3,
            **common,
        )
    raise ValueError(family)


def _forward(family: str, module):
    """(init(key, tokens), logits(params, tokens)) for a module (wrapped or not)."""
    if family != "hf":
        return (
            lambda key, tokens: module.init(key, tokens),
            lambda params, tokens: module.apply({"params": params}, tokens),
        )

    def extra(tokens):  # HF's Flax modules take the mask and positions positionally
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return jnp.ones_like(tokens), positions

    return (
        lambda key, tokens: module.init(key, tokens, *extra(tokens)),
        lambda params, tokens: module.apply({"params": params}, tokens, *extra(tokens))[0],
    )


def _loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]
    ).mean()


def _onehot_loss(logits, tokens):
    labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), labels).mean()


def _sliced_loss(logits, tokens):
    """The logits shifted, not the inputs: the model read `tokens[:, :-1]` (the batch's input
    ids), the last position's logits are dropped, the labels are the inputs shifted."""
    inputs = tokens[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], inputs[:, 1:]).mean()


def _hf_loss(logits, tokens):
    """Hugging Face's run_clm_flax, as it writes it: `shift_logits = logits[..., :-1, :]`,
    `shift_labels = labels[..., 1:]`, `optax.softmax_cross_entropy(shift_logits,
    onehot(shift_labels, logits.shape[-1]))`, the labels being the input ids."""
    from flax.training.common_utils import onehot

    labels = tokens[:, :-1]
    shift_logits, shift_labels = logits[..., :-1, :], labels[..., 1:]
    return optax.softmax_cross_entropy(shift_logits, onehot(shift_labels, logits.shape[-1])).mean()


#: The loss of each loss-form suffix of a variant's name (the rest take `_loss`).
LOSSES = {"_onehot": _onehot_loss, "_sliced": _sliced_loss, "_hfloss": _hf_loss}


def _jamp_loss(logits, tokens):
    return jamp.losses.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def build(name: str, batch: int = 8, quick: bool = False, shape: dict | None = None) -> Built:
    """The variant `name` (see the module docstring) at `batch` sequences, GPT-2 small's shape
    (QUICK's with `quick`, or `shape`: layers, d, heads, mlp, seq, vocab)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; variants: {', '.join(VARIANTS)}")
    shape = shape or (QUICK if quick else GPT2)
    family, kind = name.split("_", 1)
    suffix = kind[kind.rfind("_") :]
    loss_of = {"_losses": _jamp_loss, **LOSSES}.get(suffix, _loss)
    chunked = kind.endswith("_chunked")
    if suffix in ("_losses", "_chunked", *LOSSES):
        kind = kind.removesuffix(suffix)
    policy = POLICIES.get(kind)
    wrap_policy = policy or ("mixed_bfloat16" if kind == "plain_bf16" else None)
    if family == "lm" and kind == "hand_bf16":
        module = _model("hand", shape, jnp.bfloat16)
    elif family == "hf" and kind == "bf16":
        module = _model("hf", shape, jnp.bfloat16)
    else:
        module = _model(family, shape)
    if wrap_policy:
        module = jamp.wrap(module, wrap_policy)
    init, logits_of = _forward(family, module)
    tx = optax.adamw(LR)
    length = shape["seq"]
    sample = jnp.zeros((1, min(8, length)), jnp.int32)
    params_shape = jax.eval_shape(lambda: init(jax.random.key(0), sample)["params"])
    tokens = jax.ShapeDtypeStruct((batch, length + 1), jnp.int32)

    def make_params():
        return jax.jit(lambda: init(jax.random.key(0), sample)["params"])()

    def make_tokens():
        return jax.random.randint(jax.random.key(1), tokens.shape, 0, shape["vocab"] // 2)

    if policy:  # jamp's step

        def loss_fn(params, model_state, batch_, rng):
            del rng
            toks = batch_["tokens"]
            if chunked:  # the head applied by the loss, in chunks: no logits formed
                hidden = module.apply({"params": params}, toks[:, :-1], return_hidden=True)
                kernel = type(module.module).output_kernel(params)
                loss = jamp.losses.fused_linear_cross_entropy(
                    hidden, kernel, toks[:, 1:], dtype=jnp.bfloat16
                )
                return loss, (model_state, {})
            return loss_of(logits_of(params, toks[:, :-1]), toks), (model_state, {})

        loss_scale = jamp.loss_scale_for(policy)
        step = jax.jit(jamp.make_train_step(loss_fn, tx), donate_argnums=(0,))
        fp8_state = None
        if policy == "mixed_fp8":  # one site per fp8 matmul, found by tracing the loss once
            example = (params_shape, {}, {"tokens": tokens}, None)
            fp8_state = jamp.fp8.init_state(loss_fn, *example, recipe="delayed", history=16)

        # the params' matrices kept in the compute dtype, written by the update (not for fp8:
        # its matmuls cast with scales of their own)
        compute = None if policy == "mixed_fp8" else jamp.precision.get_policy(policy).compute_dtype

        def make_state(p):
            return jamp.TrainState.create(
                p, tx, loss_scale=loss_scale, fp8_state=fp8_state, compute_dtype=compute
            )

        abstract = (
            jax.eval_shape(make_state, params_shape),
            {"tokens": tokens},
            jax.eval_shape(lambda: jax.random.key(0)),
        )

        def make_args():
            return (make_state(make_params()), {"tokens": make_tokens()}, jax.random.key(0))

    else:  # a plain value_and_grad + optax step, as users write one

        def plain(params, opt_state, toks):
            def loss(p):
                return _loss(logits_of(p, toks[:, :-1]), toks)

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        step = jax.jit(plain, donate_argnums=(0, 1))
        abstract = (params_shape, jax.eval_shape(tx.init, params_shape), tokens)

        def make_args():
            p = make_params()
            return (p, tx.init(p), make_tokens())

    n = sum(x.size for x in jax.tree.leaves(params_shape))
    flops = model_flops(n, shape, batch)
    return Built(name, step, make_args, abstract, flops, n)


def model_flops(params: int, shape: dict, batch: int) -> float:
    """PaLM's model FLOPs of one train step: 6 N + 12 L T E per token (T: sequence, E: width)."""
    per_token = 6 * params + 12 * shape["layers"] * shape["seq"] * shape["d"]
    return float(per_token * batch * shape["seq"])


def next_state(name: str, args: tuple, out: Any) -> tuple:
    """The arguments of the next step, from this step's outputs (the state is donated)."""
    if "_jamp_" in name:
        return (out[0], args[1], args[2])
    return (out[0], out[1], args[2])


__all__ = ["GPT2", "QUICK", "VARIANTS", "Built", "build", "model_flops", "next_state"]
