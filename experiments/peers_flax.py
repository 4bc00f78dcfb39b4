"""The benchmark networks written the way a Flax user does mixed precision by hand (no jamp).

Each layer gets ``dtype=bfloat16, param_dtype=float32`` (or float16), the input is cast once and
the logits are cast back to float32. Parameter names and shapes equal jamp.models' networks, so
both are initialised from the same parameters (the benchmarks check it).

    from peers_flax import hand_model
    module = hand_model("resnet20", jnp.bfloat16, num_classes=10)
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jamp import hardware
from jamp.models.cnn import max_pool_2x2

F32 = jnp.float32


def cudnn_attention(query, key, value, bias=None, mask=None, **_):
    """Flax's attention_fn signature as cuDNN's fused kernel (causal, as the mask is): HandLM's
    attention in the GPU experiments; XLA's form where the step is traced for a CPU (a dry run)."""
    del bias, mask
    cudnn = hardware.target_platform() == "gpu"
    return jax.nn.dot_product_attention(
        query, key, value, is_causal=True, implementation="cudnn" if cudnn else None
    )


class HandCNN(nn.Module):
    dtype: object
    num_classes: int = 10

    @nn.compact
    def __call__(self, images_NHWC, train: bool = False):
        hand = dict(dtype=self.dtype, param_dtype=F32)
        x = images_NHWC.astype(self.dtype)
        x = nn.relu(nn.Conv(32, (3, 3), padding=1, **hand)(x))
        x = nn.relu(nn.Conv(64, (3, 3), padding=1, **hand)(x))
        x = max_pool_2x2(x)  # the pooling jamp.models.SeedCNN uses (precision-free)
        x = nn.relu(nn.Dense(256, **hand)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.num_classes, **hand)(x).astype(F32)


class HandBasicBlock(nn.Module):
    filters: int
    strides: int
    dtype: object

    @nn.compact
    def __call__(self, x, train: bool):
        hand = dict(dtype=self.dtype, param_dtype=F32)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, **hand)
        y = nn.Conv(self.filters, (3, 3), self.strides, padding=1, use_bias=False, **hand)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), padding=1, use_bias=False, **hand)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False, **hand)(x)
            x = norm()(x)
        return nn.relu(x + y)


class HandResNet(nn.Module):
    stage_sizes: Sequence[int]
    dtype: object
    num_filters: int = 16
    num_classes: int = 10

    @nn.compact
    def __call__(self, images_NHWC, train: bool = False):
        hand = dict(dtype=self.dtype, param_dtype=F32)
        x = nn.Conv(self.num_filters, (3, 3), padding=1, use_bias=False, **hand)(
            images_NHWC.astype(self.dtype)
        )
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, **hand)(x))
        for stage, num_blocks in enumerate(self.stage_sizes):
            for block in range(num_blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                filters = self.num_filters * 2**stage
                # Named like jamp.models.resnet's BasicBlock_i so the parameter trees match.
                name = f"BasicBlock_{sum(self.stage_sizes[:stage]) + block}"
                x = HandBasicBlock(filters, strides, self.dtype, name=name)(x, train)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes, **hand)(x).astype(F32)


class HandDecoderBlock(nn.Module):
    num_heads: int
    mlp_dim: int
    dtype: object
    attention_fn: Optional[Callable] = None  # Flax's attention_fn; None: Flax's own

    @nn.compact
    def __call__(self, x, mask):
        hand = dict(dtype=self.dtype, param_dtype=F32)
        if self.attention_fn is not None:
            hand_attn = dict(hand, attention_fn=self.attention_fn)
        else:
            hand_attn = hand
        attn = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, deterministic=True, **hand_attn
        )
        x = x + attn(nn.LayerNorm(**hand)(x), mask=mask)
        y = nn.Dense(self.mlp_dim, **hand)(nn.LayerNorm(**hand)(x))
        return x + nn.Dense(x.shape[-1], **hand)(nn.gelu(y))


class HandLM(nn.Module):
    vocab_size: int
    dtype: object
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    mlp_dim: int = 1024
    max_len: int = 1024
    attention_fn: Optional[Callable] = None  # e.g. cudnn_attention (the GPU experiments)

    @nn.compact
    def __call__(self, tokens_BL, train: bool = False):
        hand = dict(dtype=self.dtype, param_dtype=F32)
        embed = nn.Embed(self.vocab_size, self.d_model, **hand)
        pos = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model)
        )
        x = embed(tokens_BL) + pos[: tokens_BL.shape[1]].astype(self.dtype)
        mask = nn.make_causal_mask(tokens_BL)
        for i in range(self.num_layers):  # named like jamp.models' DecoderBlock_i
            x = HandDecoderBlock(
                self.num_heads,
                self.mlp_dim,
                self.dtype,
                self.attention_fn,
                name=f"DecoderBlock_{i}",
            )(x, mask)
        return embed.attend(nn.LayerNorm(**hand)(x)).astype(F32)


def hand_model(name: str, dtype, num_classes: int, **model_config) -> nn.Module:
    """The hand-written twin of ``jamp.models.get_model(name, num_classes, **model_config)``."""
    if name == "seed_cnn":
        return HandCNN(dtype=dtype, num_classes=num_classes, **model_config)
    if name == "resnet20":
        return HandResNet((3, 3, 3), dtype=dtype, num_classes=num_classes, **model_config)
    if name == "transformer_lm":
        return HandLM(vocab_size=num_classes, dtype=dtype, **model_config)
    raise ValueError(f"no hand-written twin of {name!r}")
