"""Plain Flax models (linen, and NNX in `nnx_models`) used by the training program, tests and
benchmarks.

They contain no precision code at all: the precision comes only from `jamp.wrap`.
"""

import dataclasses
import inspect
from typing import Callable

from jamp.models import nnx_models
from jamp.models.cnn import SeedCNN
from jamp.models.llama import LlamaLM
from jamp.models.resnet import ResNet, resnet18, resnet20
from jamp.models.transformer import TransformerLM

__all__ = [
    "LlamaLM",
    "MODELS",
    "NnxModel",
    "ResNet",
    "SeedCNN",
    "TransformerLM",
    "get_model",
    "is_nnx",
    "model_task",
    "resnet18",
    "resnet20",
]


def _seed_cnn(num_classes, **kwargs):
    return SeedCNN(num_classes=num_classes, **kwargs)


def _transformer_lm(num_classes, **kwargs):
    return TransformerLM(vocab_size=num_classes, **kwargs)


def _llama_lm(num_classes, **kwargs):
    return LlamaLM(vocab_size=num_classes, **kwargs)


@dataclasses.dataclass(frozen=True)
class NnxModel:
    """An NNX model to build once its input shape is known (NNX layers take explicit sizes):
    `build(input_shape, rngs)`; `input_shape` is one example's (e.g. (H, W, C) or (L,))."""

    name: str
    build: Callable


def _nnx(name, cls, size_kw=None):
    def builder(num_classes, **kwargs):
        try:  # a keyword the model does not take fails here, as a linen model's does
            if isinstance(cls, type):  # (an NNX class's own signature is its metaclass's)
                inspect.signature(cls.__init__).bind_partial(None, num_classes, **kwargs)
            else:
                inspect.signature(cls).bind_partial(num_classes, **kwargs)
        except TypeError as e:
            raise TypeError(str(e)) from None

        def build(input_shape, rngs):
            sizes = {size_kw: tuple(input_shape)} if size_kw else {}
            return cls(num_classes, **sizes, **kwargs, rngs=rngs)

        return NnxModel(name, build)

    builder.nnx = True
    return builder


def _resnet20_nnx_cls(num_classes, num_filters=16, *, image_shape=(32, 32, 3), rngs=None):
    return nnx_models.ResNet(
        (3, 3, 3), num_filters, num_classes, in_channels=image_shape[-1], rngs=rngs
    )


# name -> (builder(num_classes, **model_config), task it fits)
_REGISTRY = {
    "seed_cnn": (_seed_cnn, "classification"),
    "resnet20": (resnet20, "classification"),
    "resnet18": (resnet18, "classification"),
    "transformer_lm": (_transformer_lm, "lm"),
    "llama_lm": (_llama_lm, "lm"),
    # The same architectures in Flax NNX (jamp.models.nnx_models), wrapped by jamp.wrap's NNX path.
    "seed_cnn_nnx": (_nnx("seed_cnn_nnx", nnx_models.SeedCNN, "image_shape"), "classification"),
    "resnet20_nnx": (_nnx("resnet20_nnx", _resnet20_nnx_cls, "image_shape"), "classification"),
    "transformer_lm_nnx": (_nnx("transformer_lm_nnx", nnx_models.TransformerLM), "lm"),
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


def is_nnx(name: str) -> bool:
    """Whether the registered model `name` is a Flax NNX one (built as an `NnxModel`)."""
    model_task(name)  # an unknown name fails with the accepted ones
    return getattr(_REGISTRY[name][0], "nnx", False)
