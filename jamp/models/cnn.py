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

    Example::

      logits = SeedCNN(num_classes=10).apply(variables, images_NHWC)
    """

    num_classes: int = 10

    @nn.compact
    def __call__(self, images_NHWC, train: bool = False):
        del train  # no dropout or batch statistics; accepted so every model has the same signature
        x = nn.relu(nn.Conv(32, (3, 3), padding=1)(images_NHWC))
        x = nn.relu(nn.Conv(64, (3, 3), padding=1)(x))
        x = max_pool_2x2(x)
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(self.num_classes)(x)
