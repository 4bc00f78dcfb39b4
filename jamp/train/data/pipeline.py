"""Batching, shuffling, normalising and prefetching, the same for every dataset.

Built on grain's `MapDataset` rather than a hand-written loader because grain already has what a
resumable pipeline needs, and keeps it tested:

* an index shuffle that is a pure function of (seed, epoch, index), so the batch at step k is
  computable without producing the k batches before it: resuming is a slice, not a replay;
* batching over an infinitely repeated dataset by index arithmetic;
* `to_iter_dataset`, which builds whole batches ahead of the consumer in a thread pool, in order.

Examples are decoded by the source (tfds's `as_data_source` or a synthetic sequence); the batch
function stacks them and normalises the whole batch at once with numpy.
"""

import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from jamp.train.data.config import DatasetInfo, Splits

# The seed recipe: per-channel mean and std of 0.5 on [0, 1] pixels, i.e. pixels in [-1, 1].
MEAN = 0.5
STD = 0.5


def normalize_images(images_nhwc: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [0, 1] -> (x - MEAN) / STD per channel, i.e. [-1, 1]."""
    scaled = images_nhwc.astype(np.float32) / np.float32(255.0)  # 255 / 255 is exactly 1
    return (scaled - np.float32(MEAN)) / np.float32(STD)


def _shuffle_seed(seed: int) -> int:
    # grain reshuffles epoch e with seed + e; hashing the user's seed first keeps seed 1's first
    # epoch from being seed 0's second.
    return int(np.random.SeedSequence(seed).generate_state(1)[0])


# Training splits whose decoded examples fit in this many bytes are decoded once and served from
# memory: decoding (e.g. PNG) on every read would make the step wait for data on small models.
CACHE_BYTES = 2 << 30


def _load_in_memory(source, keys) -> dict[str, np.ndarray] | None:
    """The split's `keys` as stacked arrays, or None if it would exceed `CACHE_BYTES`."""
    size = len(source)
    if size == 0:
        return None
    first = source[0]
    if size * sum(np.asarray(first[key]).nbytes for key in keys) > CACHE_BYTES:
        return None
    examples = [first] + [source[i] for i in range(1, size)]
    return {key: np.stack([np.asarray(ex[key]) for ex in examples]) for key in keys}


class Dataset:
    """A dataset cut into global batches of numpy arrays.

    `info` describes it; `train_batches(step)` and `eval_batches()` produce the batches.
    Classification batches are {"image": f32[B, H, W, C] in [-1, 1], "label": i32[B]}; language-
    model batches are {"tokens": i32[B, seq_len + 1]}; eval batches add "mask": f32[B].

    In a multi-process run (`process_count` > 1) every batch is this process's slice of the global
    batch: B = `local_batch_size` = `batch_size // process_count` examples, the
    `process_index`-th consecutive block of the batch one process would read.
    """

    def __init__(
        self,
        splits: Splits,
        batch_size: int,
        seed: int = 0,
        prefetch: int = 4,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process {process_index} of {process_count} does not exist")
        if batch_size % process_count:
            raise ValueError(
                f"batch_size {batch_size} does not divide over {process_count} processes"
            )
        self.info: DatasetInfo = splits.info
        self.batch_size = batch_size  # global
        self.local_batch_size = batch_size // process_count
        self._process = (process_index, process_count)
        self._train = splits.train
        self._eval = splits.eval
        self._seed = _shuffle_seed(seed)
        prefetch = max(1, prefetch)
        self._read_options = grain.ReadOptions(
            num_threads=min(prefetch, os.cpu_count() or 1), prefetch_buffer_size=prefetch
        )
        self._cache = _load_in_memory(self._train, self._keys())

    def _keys(self) -> tuple[str, ...]:
        return ("tokens",) if self.info.task == "lm" else ("image", "label")

    def _finish(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Stacked raw fields -> the batch the model sees (dtypes, normalisation)."""
        if self.info.task == "lm":
            return {"tokens": arrays["tokens"].astype(np.int32)}
        return {
            "image": normalize_images(arrays["image"]),
            "label": arrays["label"].astype(np.int32),
        }

    def _gather(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """A batch from the in-memory training split: one vectorised gather per field."""
        assert self._cache is not None  # only in-memory splits gather
        index = np.asarray(indices, dtype=np.int64)
        return self._finish({key: value[index] for key, value in self._cache.items()})

    def _collate(self, examples: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
        return self._finish(
            {key: np.stack([np.asarray(ex[key]) for ex in examples]) for key in self._keys()}
        )

    def _collate_padded(self, examples: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
        real, size = len(examples), self.local_batch_size
        # This process's share of the last global batch may hold no real example at all; the
        # split's first example then lends the shapes and dtypes of the padding.
        batch = self._collate(examples or [self._eval[0]])
        padded = {}
        for key, value in batch.items():
            padding = np.zeros((size - real, *value.shape[1:]), value.dtype)
            padded[key] = np.concatenate([value[:real], padding])
        padded["mask"] = (np.arange(size) < real).astype(np.float32)
        return padded

    def _iterate(self, batches: grain.MapDataset) -> Iterator[dict[str, np.ndarray]]:
        iterator = iter(batches.to_iter_dataset(self._read_options))
        iterator.start_prefetch()  # start filling the buffer now, e.g. while the step compiles
        return iterator

    def train_batches(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Training batches from step `start_step` on, forever.

        Epoch e is a fresh permutation drawn from (seed, e); batches run across epoch boundaries
        (nothing is dropped). Batch k depends only on (seed, k), so a run resumed at step k sees
        exactly the batches an uninterrupted run sees from step k on; skipping costs nothing.
        Background threads build `prefetch` batches ahead.
        """
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if self._cache is not None:
            return self._cached_train_batches(start_step)
        index, count = self._process
        batches = (
            grain.MapDataset.source(self._train)
            .shuffle(seed=self._seed)
            .repeat()
            .batch(self.local_batch_size, drop_remainder=True, batch_fn=self._collate)
        )
        # Global batch k is local batches k * count ... k * count + count - 1 of the same stream.
        return self._iterate(batches[start_step * count + index :: count])

    def _cached_train_batches(self, start_step: int) -> Iterator[dict[str, np.ndarray]]:
        """`train_batches` for an in-memory split: the same contract, vectorised in numpy.

        A batch costs one index computation and one gather per field (tens of microseconds), so
        it is made on demand: a prefetch thread would only contend with the training loop.
        """
        size, step = len(self._train), start_step
        order: dict[int, np.ndarray] = {}  # epoch -> its permutation

        def permutation(epoch):
            if epoch not in order:
                order.clear()  # epochs only move forward: keep one
                rng = np.random.default_rng([self._seed, epoch])
                order[epoch] = rng.permutation(size)
            return order[epoch]

        first = self._process[0] * self.local_batch_size  # this process's slice of each batch
        while True:
            start = step * self.batch_size + first
            positions = np.arange(start, start + self.local_batch_size)
            epochs, within = np.divmod(positions, size)
            index = np.concatenate([permutation(e)[within[epochs == e]] for e in np.unique(epochs)])
            yield self._gather(index)
            step += 1

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """One pass over the eval split, in order, in full batches with a "mask" (1 real, 0 pad).

        Every process gets `num_eval_batches()` batches, padding included: each eval step is a
        collective that all processes have to join.
        """
        size, first = len(self._eval), self._process[0] * self.local_batch_size

        def local_batch(k):
            start = k * self.batch_size + first
            return self._collate_padded(
                [self._eval[i] for i in range(start, min(start + self.local_batch_size, size))]
            )

        return self._iterate(grain.MapDataset.range(self.num_eval_batches()).map(local_batch))

    def num_eval_batches(self) -> int:
        return -(-self.info.num_eval_examples // self.batch_size)
