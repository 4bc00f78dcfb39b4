"""The seed CNN, the CIFAR ResNet and the Transformer LM written in Flax NNX.

The same architectures (and initialisations) as the linen models beside this file, written as an
NNX user writes them: layers built in `__init__` with explicit input sizes and `rngs`, training
and evaluation modes set with `model.train()` / `model.eval()` (dropout, batch statistics) rather
than a `train` argument. No precision code: the precision comes only from `jamp.wrap`.

Example::

  model = SeedCNN(num_classes=10, image_shape=(32, 32, 3), rngs=nnx.Rngs(0))
  logits = model(images_NHWC)
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from jamp.models.cnn import max_pool_2x2


class SeedCNN(nnx.Module):
    """conv 32 (3x3) + ReLU; conv 64 (3x3) + ReLU + 2x2 max-pool; dense 256 + ReLU; dense classes.

    `image_shape` (H, W, C) sizes the first dense layer; `stem_multiplier` and `hidden_gain` as in
    the linen model (`hidden_gain` g != 1: dense1's weights g times larger, a LayerNorm `norm`
    after it).
    """

    def __init__(
        self,
        num_classes: int = 10,
        *,
        image_shape: Sequence[int] = (32, 32, 3),
        stem_multiplier: float = 1.0,
        hidden_gain: float = 1.0,
        rngs: nnx.Rngs,
    ):
        h, w, c = image_shape
        m = self.stem_multiplier = stem_multiplier
        init = nnx.initializers.variance_scaling(1.0 / m**2, "fan_in", "truncated_normal")
        self.conv1 = nnx.Conv(c, 32, (3, 3), padding=1, kernel_init=init, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), padding=1, rngs=rngs)
        g = self.hidden_gain = hidden_gain
        big = nnx.initializers.variance_scaling(g**2, "fan_in", "truncated_normal")
        dense1_init = big if g != 1 else nnx.initializers.lecun_normal()
        self.dense1 = nnx.Linear(64 * (h // 2) * (w // 2), 256, kernel_init=dense1_init, rngs=rngs)
        self.norm = nnx.LayerNorm(256, rngs=rngs) if g != 1 else None
        self.dense2 = nnx.Linear(256, num_classes, rngs=rngs)

    def __call__(self, images_NHWC):
        m = self.stem_multiplier
        x = self.conv1(images_NHWC)
        x = nnx.relu(x * m if m != 1 else x)
        x = max_pool_2x2(nnx.relu(self.conv2(x)))
        x = self.dense1(x.reshape(x.shape[0], -1))
        x = nnx.relu(self.norm(x) if self.norm is not None else x)
        return self.dense2(x)


def _norm(features: int, rngs: nnx.Rngs, zero_scale: bool = False) -> nnx.BatchNorm:
    # Flax linen's momentum 0.9 is NNX's too; a zero scale starts a block as the identity.
    scale_init = nnx.initializers.zeros if zero_scale else nnx.initializers.ones
    return nnx.BatchNorm(features, momentum=0.9, scale_init=scale_init, rngs=rngs)


class BasicBlock(nnx.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_features: int, filters: int, strides: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(
            in_features, filters, (3, 3), strides, padding=1, use_bias=False, rngs=rngs
        )
        self.norm1 = _norm(filters, rngs)
        self.conv2 = nnx.Conv(filters, filters, (3, 3), padding=1, use_bias=False, rngs=rngs)
        self.norm2 = _norm(filters, rngs, zero_scale=True)
        projects = strides != 1 or in_features != filters
        conv = nnx.Conv(in_features, filters, (1, 1), strides, use_bias=False, rngs=rngs)
        self.project = conv if projects else None  # None is static, a module data: set once
        self.project_norm = _norm(filters, rngs) if projects else None

    def __call__(self, x):
        y = nnx.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        if self.project is not None:
            x = self.project_norm(self.project(x))
        return nnx.relu(x + y)


class ResNet(nnx.Module):
    """A CIFAR ResNet: a 3x3 stem, then stages of `BasicBlock`s, global average pool, dense head."""

    def __init__(
        self,
        stage_sizes: Sequence[int] = (3, 3, 3),
        num_filters: int = 16,
        num_classes: int = 10,
        *,
        in_channels: int = 3,
        rngs: nnx.Rngs,
    ):
        self.stem = nnx.Conv(in_channels, num_filters, (3, 3), padding=1, use_bias=False, rngs=rngs)
        self.stem_norm = _norm(num_filters, rngs)
        blocks, features = [], num_filters
        for stage, num_blocks in enumerate(stage_sizes):
            for block in range(num_blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                filters = num_filters * 2**stage
                blocks.append(BasicBlock(features, filters, strides, rngs=rngs))
                features = filters
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(features, num_classes, rngs=rngs)

    def __call__(self, images_NHWC):
        x = nnx.relu(self.stem_norm(self.stem(images_NHWC)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


def resnet20(num_classes: int = 10, num_filters: int = 16, *, rngs: nnx.Rngs, **kwargs) -> ResNet:
    """He et al.'s CIFAR ResNet-20 (three stages of three blocks, 16/32/64 filters)."""
    return ResNet((3, 3, 3), num_filters, num_classes, rngs=rngs, **kwargs)


class DecoderBlock(nnx.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm with a residual connection."""

    def __init__(self, d_model: int, num_heads: int, mlp_dim: int, dropout_rate: float, *, rngs):
        self.norm1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads, d_model, decode=False, deterministic=True, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, mlp_dim, rngs=rngs)
        self.mlp_out = nnx.Linear(mlp_dim, d_model, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.dropout(self.attention(self.norm1(x), mask=mask))
        y = self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))
        return x + self.dropout(y)


class TransformerLM(nnx.Module):
    """Next-token logits for integer token sequences of shape [batch, length]; tied embeddings."""

    def __init__(
        self,
        vocab_size: int,
        num_layers: int = 4,
        d_model: int = 256,
        num_heads: int = 4,
        mlp_dim: int = 1024,
        max_len: int = 1024,
        dropout_rate: float = 0.0,
        *,
        rngs: nnx.Rngs,
    ):
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.pos_embedding = nnx.Param(init(rngs.params(), (max_len, d_model), jnp.float32))
        self.blocks = nnx.List(
            [
                DecoderBlock(d_model, num_heads, mlp_dim, dropout_rate, rngs=rngs)
                for _ in range(num_layers)
            ]
        )
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)

    def __call__(self, tokens_BL):
        length = tokens_BL.shape[1]
        x = self.embed(tokens_BL) + self.pos_embedding[:length]
        mask = nnx.make_causal_mask(tokens_BL)
        for block in self.blocks:
            x = block(x, mask)
        # Tied output embedding: a raw matmul against a parameter, which wrapping must still reach.
        return self.embed.attend(self.norm(x))
