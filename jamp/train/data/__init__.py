"""Input pipelines of the training program: tfds datasets, the offline digits, synthetic data.

Only the training program imports this package (the library never does). `import jamp.train.data`
costs numpy and grain; tensorflow_datasets is imported when a tfds dataset is opened, and
TensorFlow (the `train-tf` extra) only when a dataset of tfds's catalogue has to be prepared: the
offline "digits" and "pydoc" are written and read without it.

    ds = jamp.train.data.get_dataset(DataConfig("digits", batch_size=64), jax.local_device_count())
    for step, batch in zip(range(start, steps), ds.train_batches(start)): ...

Measuring input stalls: batches are built ahead by background threads, so the time the loop
spends in `next()` on the train iterator *is* the data-wait time; near zero means the input
keeps up. `next_timed` returns a batch and that time.

Datasets (`DATASETS`): "digits" (offline default: scikit-learn's 8x8 digits as a tfds dataset,
prepared into data_dir on first use), "mnist", "fashion_mnist", "cifar10", "tiny_shakespeare"
(byte tokens), "pydoc" (offline byte tokens: CPython's pydoc help texts as a tfds dataset, prepared
on first use), "synthetic_images", "synthetic_tokens". Prepare a tfds dataset for an offline
machine with `python -m jamp.train.data NAME --data_dir DIR`.
"""

import time
from collections.abc import Iterator

from jamp.train.data.config import DataConfig, DataError, DatasetInfo, resolve_data_dir
from jamp.train.data.pipeline import Dataset, normalize_images
from jamp.train.data.registry import DATASETS, get_dataset, prepare, prepare_digits, shapes


def next_timed(batches: Iterator[dict]) -> tuple[dict, float]:
    """`next(batches)` and the seconds spent waiting for it (the loop's data-wait metric)."""
    start = time.perf_counter()
    batch = next(batches)
    return batch, time.perf_counter() - start


__all__ = [
    "DATASETS",
    "DataConfig",
    "DataError",
    "Dataset",
    "DatasetInfo",
    "get_dataset",
    "next_timed",
    "normalize_images",
    "prepare",
    "prepare_digits",
    "resolve_data_dir",
    "shapes",
]
