"""jamp.train.data: offline digits and pydoc (with and without TensorFlow), mocked tfds datasets,
offline errors, synthetic data."""

import io
import itertools
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import requests
import tensorflow_datasets as tfds

from jamp.train.data import (
    DataConfig,
    DataError,
    DatasetInfo,
    get_dataset,
    next_timed,
    prepare,
    prepare_digits,
    pydoc_topics,
    tfds_sources,
)
from jamp.train.data import __main__ as data_main
from jamp.train.data import digits as digits_module
from jamp.train.data.testing import mock_tfds

DEVICES = 8


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    return prepare_digits(str(tmp_path_factory.mktemp("tfds")))


def _digits(data_dir, batch_size=64, num_devices=DEVICES, seed=0):
    cfg = DataConfig("digits", batch_size=batch_size, data_dir=data_dir, seed=seed)
    return get_dataset(cfg, num_devices)


def _take(iterator, n):
    return list(itertools.islice(iterator, n))


def _rows(images, labels):
    """Examples as hashable rows, to compare multisets of examples."""
    return sorted(bytes(img.tobytes()) + bytes([int(lab)]) for img, lab in zip(images, labels))


# --- digits: real data, prepared offline ---------------------------------------------------------


def test_digits_info_has_split_sizes_and_shapes(digits_dir):
    info = _digits(digits_dir).info
    assert info == DatasetInfo("classification", (8, 8, 1), 10, 1497, 300)


def test_digits_prepared_examples_are_sklearn_digits(digits_dir):
    from sklearn.datasets import load_digits

    sk = load_digits()
    expected = np.rint(sk.images * 255 / 16).astype(np.uint8)[..., None]
    builder = tfds.builder(digits_module.NAME, data_dir=digits_dir, file_format="array_record")
    got_images, got_labels = [], []
    for split in ("train", "test"):
        source = builder.as_data_source(split=split)
        for i in range(len(source)):
            got_images.append(source[i]["image"])
            got_labels.append(source[i]["label"])
    assert _rows(got_images, got_labels) == _rows(expected, sk.target)


def test_digits_split_is_stratified_and_disjoint():
    labels = np.repeat(np.arange(10), 40)
    split = digits_module.split_indices(labels)
    assert np.bincount(labels[split["test"]]).tolist() == [30] * 10
    assert not set(split["train"]) & set(split["test"])
    assert len(split["train"]) + len(split["test"]) == len(labels)


def test_digits_train_batch_shapes_dtypes_and_range(digits_dir):
    batch = next(_digits(digits_dir).train_batches())
    assert set(batch) == {"image", "label"}
    assert batch["image"].shape == (64, 8, 8, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (64,) and batch["label"].dtype == np.int32
    assert batch["image"].min() == -1.0 and batch["image"].max() == 1.0  # 0 and 16 both occur
    assert 0 <= batch["label"].min() and batch["label"].max() <= 9


def test_digits_prepare_is_idempotent(digits_dir, monkeypatch):
    files = sorted(os.scandir(os.path.join(digits_dir, digits_module.NAME, "1.0.0")), key=str)
    before = [(f.name, f.stat().st_mtime_ns) for f in files]

    def must_not_run(*args, **kwargs):
        raise AssertionError("prepare_digits rebuilt a prepared dataset")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", must_not_run)
    assert prepare_digits(digits_dir) == digits_dir
    files = sorted(os.scandir(os.path.join(digits_dir, digits_module.NAME, "1.0.0")), key=str)
    assert [(f.name, f.stat().st_mtime_ns) for f in files] == before


def test_digits_batches_are_deterministic_and_depend_on_seed(digits_dir):
    first = _take(_digits(digits_dir).train_batches(), 3)
    again = _take(_digits(digits_dir).train_batches(), 3)
    other = _take(_digits(digits_dir, seed=1).train_batches(), 3)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])
    assert not np.array_equal(first[0]["label"], other[0]["label"])


def test_digits_eval_batches_cover_the_test_split_once(digits_dir):
    ds = _digits(digits_dir)
    batches = list(ds.eval_batches())
    assert len(batches) == ds.num_eval_batches() == 5  # 300 = 4 * 64 + 44
    for batch in batches:
        assert set(batch) == {"image", "label", "mask"}
        assert batch["image"].shape == (64, 8, 8, 1) and batch["mask"].dtype == np.float32
    mask = np.concatenate([b["mask"] for b in batches])
    assert mask.sum() == 300 and mask[:300].all() and not mask[300:].any()
    images = np.concatenate([b["image"] for b in batches])[:300]
    labels = np.concatenate([b["label"] for b in batches])[:300]
    builder = tfds.builder(digits_module.NAME, data_dir=digits_dir, file_format="array_record")
    source = builder.as_data_source(split="test")
    raw = [source[i] for i in range(len(source))]
    expected = (np.stack([r["image"] for r in raw]).astype(np.float32) / 255 - 0.5) / 0.5
    assert _rows(images, labels) == _rows(expected, [r["label"] for r in raw])


def test_train_batches_reshuffle_every_epoch(digits_dir):
    # One batch per epoch: same examples, new order.
    epoch0, epoch1 = _take(_digits(digits_dir, batch_size=1497, num_devices=1).train_batches(), 2)
    assert _rows(epoch0["image"], epoch0["label"]) == _rows(epoch1["image"], epoch1["label"])
    assert not np.array_equal(epoch0["label"], epoch1["label"])


def test_train_batches_resume_where_an_uninterrupted_run_would_be(digits_dir):
    k = 30  # past the end of the first epoch (1497 / 64 = 23.4 batches)
    uninterrupted = _take(_digits(digits_dir).train_batches(), k + 3)[k:]
    resumed = _take(_digits(digits_dir).train_batches(start_step=k), 3)
    for a, b in zip(uninterrupted, resumed):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])


def test_digits_png_encoding_is_lossless_grayscale():
    from PIL import Image

    image = np.arange(64, dtype=np.uint8).reshape(8, 8, 1) * 4
    with Image.open(io.BytesIO(digits_module.encode_png(image))) as decoded:
        assert decoded.mode == "L" and decoded.format == "PNG"
        np.testing.assert_array_equal(np.asarray(decoded), image[..., 0])


def test_writing_digits_says_nothing_is_downloaded(tmp_path, capsys):
    prepare_digits(str(tmp_path))
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if "jamp_digits" in line]
    assert err == [
        f"writing dataset 'jamp_digits' to {tmp_path} from scikit-learn's copy of the digits; "
        "nothing is downloaded (once: later runs reuse it)"
    ]
    assert "Downloading" not in captured.out + captured.err  # tfds's "Unknown size" line
    assert "downloaded and prepared" not in captured.out + captured.err


# Hides TensorFlow from the interpreter as if it were not installed (tfds asks importlib, so an
# entry of None in sys.modules would not do): what the `train` extra, without `train-tf`, is.
_WITHOUT_TENSORFLOW = """
import importlib.machinery, sys

class _NoTensorFlow(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == "tensorflow":
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [
    _NoTensorFlow if f is importlib.machinery.PathFinder else f for f in sys.meta_path
]
"""


def test_digits_and_pydoc_are_written_and_read_without_tensorflow(tmp_path):
    data_dir = str(tmp_path / "without_tf")
    code = _WITHOUT_TENSORFLOW + (
        "import importlib.util\n"
        "from jamp.train.data import DataConfig, get_dataset, prepare\n"
        "assert importlib.util.find_spec('tensorflow') is None\n"
        "for name in ('digits', 'pydoc'):\n"
        f"    prepare(name, {data_dir!r})\n"
        f"    cfg = DataConfig(name, batch_size=8, data_dir={data_dir!r}, seq_len=16)\n"
        "    ds = get_dataset(cfg, 8)\n"
        "    shapes = [v.shape for v in next(ds.train_batches()).values()]\n"
        "    print(name, ds.info.num_train_examples, ds.info.num_eval_examples, *shapes)\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'tensorflow'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    digits_line, pydoc_line, tensorflow = out.stdout.splitlines()
    assert digits_line == "digits 1497 300 (8, 8, 8, 1) (8,)"
    assert pydoc_line.startswith("pydoc ") and pydoc_line.endswith(" (8, 17)")
    assert tensorflow == "[]"


@pytest.mark.skipif(
    not tfds_sources.tensorflow_installed(), reason="tfds encodes numpy images with TensorFlow"
)
def test_digits_written_with_pillow_read_as_those_tensorflow_encoded(tmp_path, monkeypatch):
    # Directories prepared before Pillow encoded the digits hold TensorFlow's PNGs: given a numpy
    # image, tfds encodes it with TensorFlow. Both read the same, in the same order.
    pillow = _digits(prepare_digits(str(tmp_path / "pillow")), batch_size=300, num_devices=1)
    monkeypatch.setattr(digits_module, "encode_png", lambda image: image)
    tensorflow = _digits(prepare_digits(str(tmp_path / "tf")), batch_size=300, num_devices=1)
    for ours, theirs in [
        (next(pillow.train_batches(7)), next(tensorflow.train_batches(7))),
        *zip(pillow.eval_batches(), tensorflow.eval_batches()),
    ]:
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key])


def test_cli_prepares_digits(digits_dir, capsys):
    assert data_main.main(["digits", "--data_dir", digits_dir]) == 0
    assert digits_dir in capsys.readouterr().out


# --- pydoc: real text, prepared offline ----------------------------------------------------------


@pytest.fixture(scope="module")
def pydoc_dir(tmp_path_factory):
    return prepare("pydoc", str(tmp_path_factory.mktemp("tfds")))


def _pydoc_split_bytes() -> dict[str, bytes]:
    """Each split's topics joined in name order, from this Python's pydoc_data directly."""
    topics = pydoc_topics.load_topics()
    return {
        split: b"".join(topics[name].encode("utf-8") for name in names)
        for split, names in pydoc_topics.split_topics(topics).items()
    }


def test_pydoc_split_is_deterministic_disjoint_whole_topics_and_about_a_tenth():
    topics = pydoc_topics.load_topics()
    split = pydoc_topics.split_topics(topics)
    assert split == pydoc_topics.split_topics(dict(reversed(topics.items())))  # order-free
    assert not set(split["train"]) & set(split["test"])
    assert sorted(split["train"] + split["test"]) == sorted(topics)
    sizes = {name: len(text.encode("utf-8")) for name, text in topics.items()}
    fraction = sum(sizes[n] for n in split["test"]) / sum(sizes.values())
    assert 0.08 < fraction <= pydoc_topics.TEST_FRACTION
    assert len(split["test"]) >= 5  # many topics, not one big one


def test_pydoc_split_of_made_up_topics_respects_the_byte_budget():
    topics = {f"t{i}": "x" * (10 + i) for i in range(50)}
    split = pydoc_topics.split_topics(topics)
    test_bytes = sum(len(topics[n]) for n in split["test"])
    assert 0 < test_bytes <= 0.1 * sum(map(len, topics.values()))
    assert split == pydoc_topics.split_topics(topics)


def test_pydoc_prepared_topics_round_trip_byte_for_byte(pydoc_dir):
    topics = pydoc_topics.load_topics()
    builder = tfds.builder(pydoc_topics.NAME, data_dir=pydoc_dir, file_format="array_record")
    for split, names in pydoc_topics.split_topics(topics).items():
        source = builder.as_data_source(split=split)
        got = [(source[i]["topic"].decode(), source[i]["text"]) for i in range(len(source))]
        assert got == [(name, topics[name].encode("utf-8")) for name in names]  # in name order
    assert builder.info.metadata["python_version"] == sys.version.split()[0]


def test_pydoc_info_counts_byte_windows(pydoc_dir):
    split = _pydoc_split_bytes()
    cfg = DataConfig("pydoc", batch_size=32, data_dir=pydoc_dir, seq_len=128)
    info = get_dataset(cfg, DEVICES).info
    windows = [(len(split[s]) - 1) // 128 for s in ("train", "test")]
    assert info == DatasetInfo("lm", (128,), 256, *windows)
    assert 3000 < windows[0] and 300 < windows[1]  # ~420 KB / ~46 KB of text


def test_pydoc_eval_batches_are_the_test_text_in_order(pydoc_dir):
    cfg = DataConfig("pydoc", batch_size=64, data_dir=pydoc_dir, seq_len=64)
    batches = list(get_dataset(cfg, DEVICES).eval_batches())
    tokens = np.concatenate([b["tokens"] for b in batches])
    mask = np.concatenate([b["mask"] for b in batches]).astype(bool)
    assert tokens.dtype == np.int32 and tokens.shape[1] == 65
    real = tokens[mask].astype(np.uint8)
    # Windows overlap by one byte: the first window and every later one's last 64 bytes.
    text = real[0].tobytes() + b"".join(w[1:].tobytes() for w in real[1:])
    test = _pydoc_split_bytes()["test"]
    assert text == test[: len(text)] and len(test) - len(text) < 64


def test_pydoc_train_batches_are_deterministic_windows_of_the_train_text(pydoc_dir):
    cfg = DataConfig("pydoc", batch_size=16, data_dir=pydoc_dir, seq_len=32)
    first = _take(get_dataset(cfg, DEVICES).train_batches(), 2)
    again = _take(get_dataset(cfg, DEVICES).train_batches(), 2)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    train = _pydoc_split_bytes()["train"]
    windows = {train[i : i + 33] for i in range(0, len(train) - 32, 32)}
    assert first[0]["tokens"].shape == (16, 33)
    assert {w.tobytes() for w in first[0]["tokens"].astype(np.uint8)} <= windows


def test_cli_prepares_pydoc(pydoc_dir, capsys):
    assert data_main.main(["pydoc", "--data_dir", pydoc_dir]) == 0
    assert pydoc_dir in capsys.readouterr().out


# --- tfds datasets, mocked ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, shape",
    [("mnist", (28, 28, 1)), ("fashion_mnist", (28, 28, 1)), ("cifar10", (32, 32, 3))],
)
def test_tfds_image_datasets_through_mock_data(name, shape):
    with mock_tfds(num_examples=20):
        ds = get_dataset(DataConfig(name, batch_size=16), DEVICES)
        batch = next(ds.train_batches())
        evals = list(ds.eval_batches())
    assert ds.info == DatasetInfo("classification", shape, 10, 20, 20)
    assert batch["image"].shape == (16, *shape) and batch["image"].dtype == np.float32
    assert -1.0 <= batch["image"].min() and batch["image"].max() <= 1.0
    assert batch["image"].min() < -0.9 and batch["image"].max() > 0.9  # random pixels: full range
    assert batch["label"].dtype == np.int32 and set(batch["label"]) <= set(range(10))
    assert [b["mask"].sum() for b in evals] == [16, 4]


def test_tiny_shakespeare_becomes_byte_token_windows():
    with mock_tfds(num_examples=3):
        ds = get_dataset(DataConfig("tiny_shakespeare", batch_size=8, seq_len=4), DEVICES)
        batch = next(ds.train_batches())
        evals = list(ds.eval_batches())
    assert ds.info.task == "lm" and ds.info.input_shape == (4,) and ds.info.num_classes == 256
    assert ds.info.num_train_examples > 0
    assert batch["tokens"].shape == (8, 5) and batch["tokens"].dtype == np.int32
    assert 0 <= batch["tokens"].min() and batch["tokens"].max() < 256
    assert sum(b["mask"].sum() for b in evals) == ds.info.num_eval_examples


def test_token_windows_overlap_by_one_token():
    windows = tfds_sources.TokenWindows(np.frombuffer(b"abcdefghij", np.uint8), seq_len=3)
    assert len(windows) == 3
    assert [bytes(windows[i]["tokens"]) for i in range(3)] == [b"abcd", b"defg", b"ghij"]


def test_text_that_is_too_short_for_one_sequence_is_a_data_error():
    with mock_tfds(num_examples=1), pytest.raises(DataError, match="smaller seq_len"):
        get_dataset(DataConfig("tiny_shakespeare", batch_size=8, seq_len=10_000), DEVICES)


# --- tfds datasets absent offline ---------------------------------------------------------------


def _assert_one_line_naming(error, name, data_dir):
    message = str(error.value)
    assert "\n" not in message and f"'{name}'" in message and data_dir in message
    assert f"python -m jamp.train.data {name}" in message


def test_absent_dataset_without_download_is_a_one_line_error(tmp_path):
    cfg = DataConfig("cifar10", batch_size=8, data_dir=str(tmp_path), download=False)
    with pytest.raises(DataError) as error:
        get_dataset(cfg, DEVICES)
    _assert_one_line_naming(error, "cifar10", str(tmp_path))


def test_absent_dataset_offline_fails_fast_before_downloading(tmp_path, monkeypatch):
    def offline(address, timeout=None):
        raise OSError(f"[Errno -2] Name or service not known: {address[0]}")

    def must_not_run(*args, **kwargs):
        raise AssertionError("tried to download although the hosts are unreachable")

    monkeypatch.setattr(tfds_sources.socket, "create_connection", offline)
    monkeypatch.setattr(tfds_sources, "tensorflow_installed", lambda: True)  # with train-tf
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", must_not_run)
    start = time.perf_counter()
    with pytest.raises(DataError, match="unreachable") as error:
        get_dataset(DataConfig("mnist", batch_size=8, data_dir=str(tmp_path)), DEVICES)
    assert time.perf_counter() - start < 5
    _assert_one_line_naming(error, "mnist", str(tmp_path))


def test_a_failing_download_becomes_a_one_line_error(tmp_path, monkeypatch):
    def network_down(*args, **kwargs):
        raise requests.exceptions.ConnectionError("Max retries exceeded\nwith url: ...")

    monkeypatch.setattr(tfds_sources, "unreachable_host", lambda urls: None)
    monkeypatch.setattr(tfds_sources, "tensorflow_installed", lambda: True)  # with train-tf
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", network_down)
    with pytest.raises(DataError, match="downloading it failed") as error:
        get_dataset(DataConfig("fashion_mnist", batch_size=8, data_dir=str(tmp_path)), DEVICES)
    _assert_one_line_naming(error, "fashion_mnist", str(tmp_path))


def test_preparing_a_catalogue_dataset_without_tensorflow_names_the_extra(tmp_path, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("tried to prepare without TensorFlow")

    monkeypatch.setattr(tfds_sources, "tensorflow_installed", lambda: False)
    monkeypatch.setattr(tfds_sources, "unreachable_host", must_not_run)
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", must_not_run)
    with pytest.raises(DataError) as error:
        get_dataset(DataConfig("cifar10", batch_size=8, data_dir=str(tmp_path)), DEVICES)
    assert str(error.value) == (
        f"dataset 'cifar10' is not prepared in {tmp_path}, and tfds needs TensorFlow to prepare "
        f"it (not to read it): pip install -e '.[train-tf]' in a checkout of jamp, or copy a "
        f"prepared "
        f"{tmp_path}/cifar10 here"
    )


def test_a_module_missing_while_preparing_names_the_extra_to_install(tmp_path, monkeypatch):
    def no_sklearn(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", no_sklearn)
    with pytest.raises(DataError) as error:
        prepare_digits(str(tmp_path))
    assert str(error.value) == (
        "preparing dataset 'jamp_digits' needs the module sklearn: pip install -e '.[train]' in a "
        "checkout of jamp"
    )


def test_probe_reports_the_host_that_refuses(monkeypatch):
    tried = []

    def refuse_second(address, timeout=None):
        tried.append(address)
        if address[0] == "b.example":
            raise OSError("refused")
        return type("Socket", (), {"close": lambda self: None})()

    monkeypatch.setattr(tfds_sources.socket, "create_connection", refuse_second)
    monkeypatch.setattr(tfds_sources.urllib.request, "getproxies", lambda: {})
    urls = ["https://a.example/x", "https://a.example/y", "http://b.example/z"]
    assert tfds_sources.unreachable_host(urls) == "b.example"
    assert tried == [("a.example", 443), ("b.example", 80)]


@pytest.mark.skipif(
    not tfds_sources.tensorflow_installed(),
    reason="tfds writes tfrecord with TensorFlow (train-tf)",
)
def test_dataset_stored_as_tfrecord_is_a_data_error(tmp_path):
    builder = tfds.builder(digits_module.NAME, data_dir=str(tmp_path))  # tfds writes tfrecord
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )
    with pytest.raises(DataError, match="stored as tfrecord") as error:
        get_dataset(DataConfig("digits", batch_size=8, data_dir=str(tmp_path)), DEVICES)
    assert "\n" not in str(error.value)


# --- synthetic datasets -------------------------------------------------------------------------


def test_synthetic_images_shapes_determinism_and_range():
    cfg = DataConfig(
        "synthetic_images", batch_size=16, image_shape=(4, 6, 2), num_classes=3,
        num_synthetic_examples=40,
    )  # fmt: skip
    ds = get_dataset(cfg, DEVICES)
    assert ds.info == DatasetInfo("classification", (4, 6, 2), 3, 40, 10)
    first, again = next(ds.train_batches()), next(get_dataset(cfg, DEVICES).train_batches())
    assert first["image"].shape == (16, 4, 6, 2) and first["image"].dtype == np.float32
    assert -1.0 <= first["image"].min() and first["image"].max() <= 1.0
    assert first["label"].dtype == np.int32 and set(first["label"]) <= {0, 1, 2}
    np.testing.assert_array_equal(first["image"], again["image"])
    assert [b["mask"].sum() for b in ds.eval_batches()] == [10]


def test_synthetic_images_follow_a_learnable_rule():
    cfg = DataConfig("synthetic_images", batch_size=64, image_shape=(8, 8, 3), num_classes=4)
    batch = next(get_dataset(cfg, DEVICES).train_batches())
    # Nearest class mean classifies (most of) the batch: the label is in the image.
    means = np.stack([batch["image"][batch["label"] == c].mean(0) for c in range(4)])
    dists = ((batch["image"][:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
    assert (dists.argmin(1) == batch["label"]).mean() > 0.9


def test_synthetic_tokens_shapes_and_vocab():
    cfg = DataConfig("synthetic_tokens", batch_size=8, seq_len=12, vocab_size=50)
    ds = get_dataset(cfg, DEVICES)
    assert ds.info == DatasetInfo("lm", (12,), 50, 4096, 1024)
    tokens = next(ds.train_batches())["tokens"]
    assert tokens.shape == (8, 13) and tokens.dtype == np.int32
    assert 0 <= tokens.min() and tokens.max() < 50
    steps = np.diff(tokens, axis=1) % 50  # each sequence counts in one stride
    assert (steps == steps[:, :1]).all()


# --- errors and helpers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch_size, message",
    [
        (10, "batch_size 10 does not divide evenly over 8 devices: use a multiple of 8"),
        (0, "batch_size must be positive, got 0"),
        (-8, "batch_size must be positive, got -8"),
    ],
)
def test_bad_batch_sizes_are_data_errors(batch_size, message):
    with pytest.raises(DataError) as error:
        get_dataset(DataConfig("synthetic_images", batch_size=batch_size), DEVICES)
    assert str(error.value) == message
    assert isinstance(error.value, ValueError)


def test_unknown_dataset_lists_the_known_names():
    with pytest.raises(DataError, match="unknown dataset 'imagenet'") as error:
        get_dataset(DataConfig("imagenet", batch_size=8), DEVICES)
    for name in ("digits", "mnist", "cifar10", "tiny_shakespeare", "pydoc", "synthetic_tokens"):
        assert name in str(error.value)


def test_next_timed_returns_the_batch_and_the_wait():
    ds = get_dataset(DataConfig("synthetic_tokens", batch_size=8, seq_len=4), DEVICES)
    batch, waited = next_timed(ds.train_batches())
    assert batch["tokens"].shape == (8, 5) and waited >= 0


def test_importing_jamp_data_pulls_in_neither_tfds_nor_tensorflow():
    code = (
        "import sys, jamp.train.data; "
        "print(sorted(m for m in ('tensorflow', 'tensorflow_datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_how_to_provide_names_the_prepare_command_users_can_run():
    from jamp.train.data.tfds_sources import how_to_provide

    assert "python -m jamp.train.data digits --data_dir=/d" in how_to_provide("jamp_digits", "/d")
    assert "no network" in how_to_provide("jamp_pydoc", "/d")
    assert "python -m jamp.train.data mnist --data_dir=/d" in how_to_provide("mnist", "/d")
