"""The dataset registry: name -> a function that opens the dataset's train and eval splits."""

import functools
from collections.abc import Callable

from jamp.train.data.config import DataConfig, DataError, DatasetInfo, Splits, resolve_data_dir
from jamp.train.data.pipeline import Dataset


def _digits(cfg: DataConfig) -> Splits:
    from jamp.train.data import digits, tfds_sources  # tfds is imported only for tfds datasets

    data_dir = resolve_data_dir(cfg.data_dir)
    builder, sources = tfds_sources.open_splits(
        digits.NAME, ["train", "test"], data_dir, cfg.download
    )
    return _image_splits(builder, sources["train"], sources["test"])


def _tfds_images(name: str, eval_split: str, cfg: DataConfig) -> Splits:
    from jamp.train.data import tfds_sources

    data_dir = resolve_data_dir(cfg.data_dir)
    builder, sources = tfds_sources.open_splits(name, ["train", eval_split], data_dir, cfg.download)
    return _image_splits(builder, sources["train"], sources[eval_split])


def _image_splits(builder, train, eval_) -> Splits:
    from jamp.train.data.tfds_sources import ImageExamples

    features = builder.info.features
    info = DatasetInfo(
        task="classification",
        input_shape=tuple(features["image"].shape),
        num_classes=int(features["label"].num_classes),
        num_train_examples=len(train),
        num_eval_examples=len(eval_),
    )
    return Splits(info, ImageExamples(train), ImageExamples(eval_))


def _pydoc(cfg: DataConfig) -> Splits:
    from jamp.train.data import pydoc_topics  # defines the builder before tfds looks it up

    return _tfds_text(pydoc_topics.NAME, "test", cfg)


def _tfds_text(name: str, eval_split: str, cfg: DataConfig) -> Splits:
    from jamp.train.data import tfds_sources

    data_dir = resolve_data_dir(cfg.data_dir)
    _, sources = tfds_sources.open_splits(name, ["train", eval_split], data_dir, cfg.download)
    windows = {}
    for split, source in sources.items():
        tokens = tfds_sources.text_bytes(source)
        windows[split] = tfds_sources.TokenWindows(tokens, cfg.seq_len)
        if not windows[split]:
            raise DataError(
                f"split '{split}' of '{name}' holds {len(tokens)} bytes, too few for one "
                f"sequence of seq_len + 1 = {cfg.seq_len + 1}: use a smaller seq_len"
            )
    info = DatasetInfo(
        task="lm",
        input_shape=(cfg.seq_len,),
        num_classes=256,  # byte-level tokens: no vocabulary file to build, ship or get wrong
        num_train_examples=len(windows["train"]),
        num_eval_examples=len(windows[eval_split]),
    )
    return Splits(info, windows["train"], windows[eval_split])


def _num_synthetic(cfg: DataConfig) -> tuple[int, int]:
    if cfg.num_synthetic_examples < 1:
        raise DataError(f"num_synthetic_examples must be >= 1, got {cfg.num_synthetic_examples}")
    return cfg.num_synthetic_examples, max(1, cfg.num_synthetic_examples // 4)


def _synthetic_images(cfg: DataConfig) -> Splits:
    from jamp.train.data.synthetic import SyntheticImages

    n_train, n_eval = _num_synthetic(cfg)
    shape, classes = tuple(cfg.image_shape), cfg.num_classes
    if len(shape) != 3 or min(shape) < 1 or classes < 1:
        raise DataError(
            f"synthetic images need image_shape (H, W, C) and num_classes >= 1, got {shape} and {classes}"
        )
    info = DatasetInfo("classification", shape, classes, n_train, n_eval)
    train = SyntheticImages(shape, classes, cfg.seed, 0, n_train)
    eval_ = SyntheticImages(shape, classes, cfg.seed, n_train, n_eval)
    return Splits(info, train, eval_)


def _synthetic_tokens(cfg: DataConfig) -> Splits:
    from jamp.train.data.synthetic import SyntheticTokens

    n_train, n_eval = _num_synthetic(cfg)
    if cfg.vocab_size < 1:
        raise DataError(f"vocab_size must be >= 1, got {cfg.vocab_size}")
    info = DatasetInfo("lm", (cfg.seq_len,), cfg.vocab_size, n_train, n_eval)
    train = SyntheticTokens(cfg.seq_len, cfg.vocab_size, cfg.seed, 0, n_train)
    eval_ = SyntheticTokens(cfg.seq_len, cfg.vocab_size, cfg.seed, n_train, n_eval)
    return Splits(info, train, eval_)


DATASETS: dict[str, Callable[[DataConfig], Splits]] = {
    "digits": _digits,
    "mnist": functools.partial(_tfds_images, "mnist", "test"),
    "fashion_mnist": functools.partial(_tfds_images, "fashion_mnist", "test"),
    "cifar10": functools.partial(_tfds_images, "cifar10", "test"),
    "tiny_shakespeare": functools.partial(_tfds_text, "tiny_shakespeare", "validation"),
    "pydoc": _pydoc,
    "synthetic_images": _synthetic_images,
    "synthetic_tokens": _synthetic_tokens,
}


def _check_batch_size(batch_size: int, num_devices: int) -> None:
    if num_devices < 1:
        raise DataError(f"num_devices must be >= 1, got {num_devices}")
    if batch_size <= 0:
        raise DataError(f"batch_size must be positive, got {batch_size}")
    if batch_size % num_devices:
        raise DataError(
            f"batch_size {batch_size} does not divide evenly over {num_devices} devices: "
            f"use a multiple of {num_devices}"
        )


def get_dataset(cfg: DataConfig, num_devices: int) -> Dataset:
    """Opens `cfg.dataset` and returns it batched in global batches of `cfg.batch_size`.

    Args:
      cfg: what to read and how.
      num_devices: devices the batch is split over, those of all processes together
        (`jax.device_count()`); `cfg.batch_size` must be a multiple.

    Returns:
      A `Dataset`: `.info`, `.train_batches(start_step)`, `.eval_batches()`; batches are this
      process's slice of each global batch when `cfg.process_count` > 1.

    Raises:
      DataError: with a one-line message: unknown name, bad batch size, or a tfds dataset that is
        absent from the data directory and cannot be downloaded.

    Example:
      >>> ds = get_dataset(DataConfig("synthetic_images", batch_size=16), num_devices=8)
      >>> next(ds.train_batches())["image"].shape
      (16, 32, 32, 3)
    """
    _check_batch_size(cfg.batch_size, num_devices)
    if cfg.seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {cfg.seq_len}")
    open_splits = DATASETS.get(cfg.dataset)
    if open_splits is None:
        raise DataError(
            f"unknown dataset '{cfg.dataset}': known datasets are {', '.join(DATASETS)}"
        )
    return Dataset(
        open_splits(cfg),
        cfg.batch_size,
        seed=cfg.seed,
        prefetch=cfg.prefetch,
        process_index=cfg.process_index,
        process_count=cfg.process_count,
    )


# One example's shape and the class count of each stored dataset, for `shapes`.
_SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "digits": ((8, 8, 1), 10),
    "mnist": ((28, 28, 1), 10),
    "fashion_mnist": ((28, 28, 1), 10),
    "cifar10": ((32, 32, 3), 10),
}


def shapes(cfg: DataConfig) -> DatasetInfo:
    """What `get_dataset(cfg, ...).info` says of the model's input, without opening anything:
    task, input shape and classes (vocabulary); the example counts are 0. For compiling a step
    abstractly (`python -m jamp.train --compile_for=...`).

    Raises:
      DataError: an unknown dataset, or bad synthetic sizes.
    """
    if cfg.dataset not in DATASETS:
        raise DataError(
            f"unknown dataset '{cfg.dataset}': known datasets are {', '.join(DATASETS)}"
        )
    if cfg.seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {cfg.seq_len}")
    if cfg.dataset in _SHAPES:
        shape, classes = _SHAPES[cfg.dataset]
        return DatasetInfo("classification", shape, classes, 0, 0)
    if cfg.dataset == "synthetic_images":
        shape = tuple(cfg.image_shape)
        if len(shape) != 3 or min(shape) < 1 or cfg.num_classes < 1:
            raise DataError(
                f"synthetic images need image_shape (H, W, C) and num_classes >= 1, got {shape} "
                f"and {cfg.num_classes}"
            )
        return DatasetInfo("classification", shape, cfg.num_classes, 0, 0)
    if cfg.dataset == "synthetic_tokens":
        if cfg.vocab_size < 1:
            raise DataError(f"vocab_size must be >= 1, got {cfg.vocab_size}")
        return DatasetInfo("lm", (cfg.seq_len,), cfg.vocab_size, 0, 0)
    return DatasetInfo("lm", (cfg.seq_len,), 256, 0, 0)  # the byte-level text datasets


def prepare(name: str, data_dir: str | None = None) -> str:
    """Downloads (if needed) and prepares dataset `name` for offline use; returns its data_dir.

    For the datasets of tfds's catalogue this needs the network and TensorFlow (the `train-tf`
    extra); "digits" and "pydoc" need neither (scikit-learn and Pillow for "digits", from the
    `train` extra). Synthetic datasets need nothing.
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset '{name}': known datasets are {', '.join(DATASETS)}")
    resolved = resolve_data_dir(data_dir)
    if not name.startswith("synthetic"):
        DATASETS[name](DataConfig(name, batch_size=1, data_dir=resolved, seq_len=1))
    return resolved


def prepare_digits(data_dir: str | None = None) -> str:
    """Builds the "digits" dataset into `data_dir` from scikit-learn's copy, once; no network.

    A second call finds it prepared and does nothing. Returns the resolved data_dir; the files are
    in `<data_dir>/jamp_digits/1.0.0/`.
    """
    return prepare("digits", data_dir)
