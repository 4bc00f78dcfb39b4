"""A residual network with batch normalization for small images (CIFAR-style)."""

import functools
from typing import Sequence

import flax.linen as nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.Conv(self.filters, (3, 3), self.strides, padding=1, use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), padding=1, use_bias=False)(y)
        # Zero-init the last scale so each block starts as the identity: trains stably without warmup.
        y = norm(scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x)
            x = norm()(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A CIFAR ResNet: a 3x3 stem, then stages of `BasicBlock`s, global average pool, dense head.

    Example::

      model = resnet20(num_classes=10)
      logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])
    """

    stage_sizes: Sequence[int]
    num_filters: int = 16
    num_classes: int = 10

    @nn.compact
    def __call__(self, images_NHWC, train: bool = False):
        x = nn.Conv(self.num_filters, (3, 3), padding=1, use_bias=False)(images_NHWC)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for stage, num_blocks in enumerate(self.stage_sizes):
            for block in range(num_blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = BasicBlock(self.num_filters * 2**stage, strides)(x, train)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


def resnet20(num_classes: int = 10, num_filters: int = 16) -> ResNet:
    """He et al.'s CIFAR ResNet-20 (three stages of three blocks, 16/32/64 filters)."""
    return ResNet(stage_sizes=(3, 3, 3), num_filters=num_filters, num_classes=num_classes)


def resnet18(num_classes: int = 10, num_filters: int = 64) -> ResNet:
    """ResNet-18's block layout (2, 2, 2, 2) with a CIFAR stem."""
    return ResNet(stage_sizes=(2, 2, 2, 2), num_filters=num_filters, num_classes=num_classes)
