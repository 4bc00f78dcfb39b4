"""Plain Flax linen models used by the training program, tests and benchmarks.

They contain no precision code at all: the precision comes only from `jamp.wrap`.
"""

from jamp.models.cnn import SeedCNN
from jamp.models.resnet import ResNet, resnet18, resnet20
from jamp.models.transformer import TransformerLM

__all__ = [
    "MODELS",
    "ResNet",
    "SeedCNN",
    "TransformerLM",
    "get_model",
    "model_task",
    "resnet18",
    "resnet20",
]


def _seed_cnn(num_classes, **kwargs):
    return SeedCNN(num_classes=num_classes, **kwargs)


def _transformer_lm(num_classes, **kwargs):
    return TransformerLM(vocab_size=num_classes, **kwargs)


# name -> (builder(num_classes, **model_config), task it fits)
_REGISTRY = {
    "seed_cnn": (_seed_cnn, "classification"),
    "resnet20": (resnet20, "classification"),
    "resnet18": (resnet18, "classification"),
    "transformer_lm": (_transformer_lm, "lm"),
}
MODELS = tuple(_REGISTRY)


def get_model(name: str, num_classes: int, **model_config):
    """Builds a registered model; `num_classes` is the vocabulary size for language models.

    Raises:
      ValueError: unknown name, or a keyword the model does not take (one line, lists what is).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")
    build, _ = _REGISTRY[name]
    try:
        return build(num_classes, **model_config)
    except TypeError as e:
        raise ValueError(
            f"model {name!r} does not accept model_config {model_config}: {e}"
        ) from None


def model_task(name: str) -> str:
    """ "classification" or "lm": the kind of dataset the model trains on."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")
    return _REGISTRY[name][1]
