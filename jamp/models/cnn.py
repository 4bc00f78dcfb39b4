"""The small CNN from jamp's seed document (a PyTorch CIFAR-10 example), in Flax."""

import flax.linen as nn


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
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(self.num_classes)(x)
