"""The small value types of `jamp.train.data`: its config, the facts a model needs, and its error."""

import dataclasses
import os
from collections.abc import Sequence
from typing import Any


class DataError(ValueError):
    """A dataset cannot be provided. The message is one line that says what to do about it."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to read and how to batch it.

    Attributes:
      dataset: a name registered in `jamp.train.data.DATASETS`.
      batch_size: the GLOBAL batch size: every batch holds this many examples, to be split evenly
        over the devices.
      data_dir: where tfds datasets live (and where "digits" is prepared). None: `$TFDS_DATA_DIR`,
        else `~/tensorflow_datasets`, as tfds itself does.
      seq_len: tokens per example for language-model datasets (batches hold `seq_len + 1`).
      seed: seeds the shuffle (and the synthetic data).
      download: let tfds download a dataset that `data_dir` lacks; off the network this fails fast.
      image_shape, num_classes, vocab_size, num_synthetic_examples: for the synthetic datasets only.
      prefetch: batches prepared ahead of the consumer by background threads.
      process_index, process_count: in a multi-process run, which process this is and how many
        there are. Each process then reads only its slice of every global batch: process i gets
        examples [i * b, (i + 1) * b) of it, b = batch_size // process_count, so the slices
        concatenated in process order are the batch a single process would read.
    """

    dataset: str
    batch_size: int
    data_dir: str | None = None
    seq_len: int = 128
    seed: int = 0
    download: bool = True
    image_shape: tuple[int, ...] = (32, 32, 3)
    num_classes: int = 10
    vocab_size: int = 256
    num_synthetic_examples: int = 4096
    prefetch: int = 4
    process_index: int = 0
    process_count: int = 1


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the model and the loop need to know about a dataset.

    Attributes:
      task: "classification" (batches hold "image" and "label") or "lm" (batches hold "tokens").
      input_shape: one example's model input: (H, W, C) for images, (seq_len,) for tokens.
      num_classes: the number of classes, or the vocabulary size for "lm".
      num_train_examples: examples in one training epoch (token windows for "lm").
      num_eval_examples: examples in one pass of eval (padding not counted).
    """

    task: str
    input_shape: tuple[int, ...]
    num_classes: int
    num_train_examples: int
    num_eval_examples: int


@dataclasses.dataclass(frozen=True)
class Splits:
    """A dataset before batching: random-access sequences of example dicts of numpy values.

    Classification examples are {"image": uint8 (H, W, C), "label": int}; language-model examples
    are {"tokens": integer (seq_len + 1,)}.
    """

    info: DatasetInfo
    train: Sequence[dict[str, Any]]
    eval: Sequence[dict[str, Any]]


def resolve_data_dir(data_dir: str | None) -> str:
    """The absolute data directory: `data_dir`, else `$TFDS_DATA_DIR`, else ~/tensorflow_datasets.

    Raises DataError if the path, or the nearest part of it that exists, is not a directory.
    """
    chosen = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    path = os.path.abspath(os.path.expanduser(chosen))
    existing = path
    while not os.path.exists(existing):  # tfds would create what is missing
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise DataError(f"data_dir {path} cannot be used: {existing} is not a directory")
    return path
