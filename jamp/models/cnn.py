"""The small CNN from jamp's seed document (a PyTorch CIFAR-10 example), in Flax."""

import flax.linen as nn


def max_pool_2x2(x_NHWC):
    """`nn.max_pool(x, (2, 2), strides=(2, 2))` as a reshape and a max over the window axes.

    The same values (odd trailing rows/columns are dropped, as by VALID pooling). The gradient
    differs only where a window holds several equal maxima (this one shares it among them,
    nn.max_pool gives it to one), and it is ~10x faster on CPU, where XLA's select-and-scatter
    made the seed CNN's pooling gradient a third of its train step.
    """
    n, h, w, c = x_NHWC.shape
    x = x_NHWC[:, : h - h % 2, : w - w % 2]
    return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class SeedCNN(nn.Module):
    """conv 32 (3x3) + ReLU; conv 64 (3x3) + ReLU + 2x2 max-pool; dense 256 + ReLU; dense classes.

    Works on any NHWC image size (CIFAR-10's 32x32x3 gives the seed's 64*16*16 -> 256 dense layer).

    `stem_multiplier` m reparametrises the first convolution as `m * conv(x; w / m)`: the same
    function at initialisation (its kernel is drawn m times smaller), but that layer's gradients
    are m times larger, the way output multipliers and learned logit scales make a single module
    outgrow fp16's range in the backward pass. 1 (the default) is the seed's model; the tests and
    the overflow experiments use it to have one module that overflows and only one.

    `hidden_gain` g != 1 draws the dense 256 layer's weights g times larger and layer-normalizes
    its output: a pre-norm projection whose activations are g times larger than the next layer
    sees, like the "massive activations" of large language models. In float32 and bfloat16 the
    norm takes the scale out; in float16 a large g overflows that layer's output (65504) in the
    forward pass, in that module only: the adaptive-precision tests and experiment use it.

    Example::

      logits = SeedCNN(num_classes=10).apply(variables, images_NHWC)
    """

    num_classes: int = 10
    stem_multiplier: float = 1.0
    hidden_gain: float = 1.0

    @nn.compact
    def __call__(self, images_NHWC, train: bool = False):
        del train  # no dropout or batch statistics; accepted so every model has the same signature
        m = self.stem_multiplier
        # lecun_normal (Flax's default) when m == 1, with m times smaller weights otherwise.
        init = nn.initializers.variance_scaling(1.0 / m**2, "fan_in", "truncated_normal")
        x = nn.Conv(32, (3, 3), padding=1, kernel_init=init)(images_NHWC)
        x = nn.relu(x * m if m != 1 else x)
        x = nn.relu(nn.Conv(64, (3, 3), padding=1)(x))
        x = max_pool_2x2(x)
        x = x.reshape(x.shape[0], -1)
        g = self.hidden_gain
        if g == 1:
            x = nn.relu(nn.Dense(256)(x))
        else:
            big = nn.initializers.variance_scaling(g**2, "fan_in", "truncated_normal")
            x = nn.relu(nn.LayerNorm()(nn.Dense(256, kernel_init=big)(x)))
        return nn.Dense(self.num_classes)(x)
