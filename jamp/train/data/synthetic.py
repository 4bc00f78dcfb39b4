"""Synthetic datasets for benchmarks and smoke runs: no files, no tfds, learnable, deterministic.

Both are random-access sequences whose example i is a pure function of (seed, i), so they go
through exactly the same batching, shuffling and prefetching as the real datasets.
"""

from collections.abc import Sequence

import numpy as np

_NOISE_PATTERNS = 64  # noise images reused across examples: cheap to build, at any image size


class SyntheticImages(Sequence):
    """Images = half a per-class random prototype + half a random noise pattern; uint8.

    A classifier can learn the rule (the prototype dominates), so a smoke run shows the loss fall.
    Memory: (num_classes + 64) images.
    """

    def __init__(self, image_shape, num_classes: int, seed: int, start: int, length: int):
        rng = np.random.default_rng([seed, 0])
        shape = (*image_shape,)
        self._prototypes = rng.integers(0, 128, (num_classes, *shape), dtype=np.uint8)
        self._noise = rng.integers(0, 128, (_NOISE_PATTERNS, *shape), dtype=np.uint8)
        labels = np.random.default_rng([seed, 1]).integers(0, num_classes, start + length)
        self._labels = labels[start:]
        self._start = start

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]  # by int index only, as grain reads a source
        label = int(self._labels[index])
        # A multiplicative hash spreads noise patterns so that they do not cycle with the index.
        noise = self._noise[((self._start + index) * 2654435761) % _NOISE_PATTERNS]
        return {"image": self._prototypes[label] + noise, "label": label}


class SyntheticTokens(Sequence):
    """Token sequences that count in random strides modulo the vocabulary: t[k] = a + b*k mod V.

    A language model learns them from two tokens of context.
    """

    def __init__(self, seq_len: int, vocab_size: int, seed: int, start: int, length: int):
        rng = np.random.default_rng([seed, 2])
        params = rng.integers(0, vocab_size, (start + length, 2))
        self._params = params[start:]
        self._steps = np.arange(seq_len + 1)
        self._vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self._params)

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]  # by int index only, as grain reads a source
        offset, stride = self._params[index]
        return {"tokens": (offset + stride * self._steps) % self._vocab_size}
