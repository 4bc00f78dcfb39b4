"""Plain Flax linen models used by the training program, tests and benchmarks.

They contain no precision code at all: the precision comes only from `jamp.wrap`.
"""

from jamp.models.cnn import SeedCNN
from jamp.models.resnet import ResNet, resnet18, resnet20
from jamp.models.transformer import TransformerLM

__all__ = ["SeedCNN", "ResNet", "resnet18", "resnet20", "TransformerLM"]
