"""Opening tfds datasets for random access, with one-line errors when they are absent offline.

Every tfds dataset, the bundled "digits" included, is opened by `open_splits`: a builder in
`array_record` format (the format with random access; tfds writes `tfrecord` unless told), prepared
if needed, then `builder.as_data_source(split)`, which reads without TensorFlow (images decode with
Pillow). jamp's own builders (`LocalBuilder`: digits, pydoc) also *write* without TensorFlow; the
builders of tfds's catalogue encode their examples with it, so preparing those needs the
`train-tf` extra, and its absence is a one-line `DataError` that names the extra.

Offline, tfds would retry each download URL ten times with exponential backoff (minutes per URL)
and, on a network that drops packets, wait without a timeout. So before downloading we check that
every host in the builder's URL list accepts a TCP connection within a few seconds, and turn a
failed check or a failed download into a one-line `DataError`.
"""

import importlib.util
import socket
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from jamp.train.data.config import DataError

FILE_FORMAT = "array_record"
PROBE_TIMEOUT_S = 3.0
# What to install for what: the program's dependencies, and those plus TensorFlow (from a
# checkout: jamp-jax is not released yet).
TRAIN_EXTRA = "pip install -e '.[train]' in a checkout of jamp"
TF_EXTRA = "pip install -e '.[train-tf]' in a checkout of jamp"


class LocalBuilder(tfds.core.GeneratorBasedBuilder):  # abstract: tfds does not register it
    """A tfds builder of data that is on this machine already: nothing is downloaded.

    tfds's "Downloading and preparing dataset Unknown size ..." and "... downloaded and prepared"
    lines would say otherwise, so they are left out; `open_splits` prints one line instead, built
    from `SOURCE`. Subclasses must write without TensorFlow (encode images with Pillow).
    """

    SOURCE = "local data"  # where the examples come from, for the line printed when writing

    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass


def how_to_provide(name: str, data_dir: str) -> str:
    if name.startswith("jamp_"):  # jamp's own builders: made locally, registered without prefix
        return (
            f"run `python -m jamp.train.data {name[5:]} --data_dir={data_dir}` (no network needed)"
        )
    return (
        f"run `python -m jamp.train.data {name} --data_dir={data_dir}` on a machine with network "
        f"and jamp's train-tf extra (and copy {data_dir}/{name} here), or set --config.data_dir to a "
        "directory that holds it"
    )


def tensorflow_installed() -> bool:
    """Whether TensorFlow can be imported (without importing it), as tfds's catalogue needs."""
    return importlib.util.find_spec("tensorflow") is not None


def unreachable_host(urls: Iterable[str], timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """The first host (or proxy) among `urls` that refuses a TCP connection in `timeout` s."""
    proxies = urllib.request.getproxies()
    seen = set()
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        proxy = proxies.get(parts.scheme)
        if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
            parts = urllib.parse.urlsplit(proxy)  # the download goes through the proxy
        address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        if address in seen:
            continue
        seen.add(address)
        try:
            socket.create_connection(address, timeout=timeout).close()
        except OSError:
            return parts.hostname
    return None


def _make_builder(name: str, data_dir: str):
    try:
        return tfds.builder(name, data_dir=data_dir, file_format=FILE_FORMAT)
    except tfds.core.registered.DatasetNotFoundError as e:
        raise DataError(f"tfds has no dataset '{name}'") from e
    except ValueError as e:
        if "file format is already set" not in str(e).lower():
            raise
        raise DataError(
            f"dataset '{name}' in {data_dir} is stored as tfrecord, which has no random access: "
            f"prepare it in array_record format instead ({how_to_provide(name, data_dir)})"
        ) from e


def _prepare(builder, name: str, data_dir: str, download: bool) -> None:
    """Runs `download_and_prepare`, unless that would hang or is not allowed: then DataError."""
    absent = f"dataset '{name}' is not prepared in {data_dir}"
    local = isinstance(builder, LocalBuilder)
    if not local:
        if not download:
            raise DataError(f"{absent} and download=False: {how_to_provide(name, data_dir)}")
        if not tensorflow_installed():  # checked first: it needs no network
            raise DataError(
                f"{absent}, and tfds needs TensorFlow to prepare it (not to read it): "
                f"{TF_EXTRA}, or copy a prepared {data_dir}/{name} here"
            )
        host = unreachable_host((builder.url_infos or {}).keys())
        if host is not None:
            raise DataError(
                f"{absent} and cannot be downloaded offline ({host} is unreachable): "
                f"{how_to_provide(name, data_dir)}"
            )
    # One line instead of tfds's per-split progress bars: this happens once per data_dir.
    if local:
        print(
            f"writing dataset '{name}' to {data_dir} from {builder.SOURCE}; nothing is "
            "downloaded (once: later runs reuse it)",
            file=sys.stderr,
        )
    else:
        print(
            f"preparing dataset '{name}' in {data_dir} (once; later runs reuse it)", file=sys.stderr
        )
    tfds.disable_progress_bar()
    try:
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(try_download_gcs=not local)
        )
    except ModuleNotFoundError as e:  # e.g. scikit-learn for digits, TensorFlow for the others
        install = TF_EXTRA if (e.name or "").startswith("tensorflow") else TRAIN_EXTRA
        raise DataError(f"preparing dataset '{name}' needs the module {e.name}: {install}") from e
    except (OSError, tfds.download.DownloadError) as e:  # requests' errors are OSErrors
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise DataError(
            f"{absent} and downloading it failed ({reason}): {how_to_provide(name, data_dir)}"
        ) from e


def open_splits(
    name: str, splits: Sequence[str], data_dir: str, download: bool
) -> tuple[Any, dict[str, Sequence[dict[str, Any]]]]:
    """The builder of tfds dataset `name` and a random-access source per split.

    Args:
      name: the tfds name.
      splits: the split names to open.
      data_dir: the tfds data directory, resolved.
      download: allow preparing a dataset that needs the network (a `LocalBuilder`'s, generated
        on this machine, is prepared regardless).

    Raises:
      DataError: unknown name, absent and not downloadable, or stored in the wrong format.
    """
    builder = _make_builder(name, data_dir)
    if not builder.is_prepared():
        _prepare(builder, name, data_dir, download)
    return builder, {split: builder.as_data_source(split=split) for split in splits}


class ImageExamples(Sequence):
    """A tfds source's examples reduced to {"image", "label"} (drops e.g. cifar10's "id")."""

    def __init__(self, source: Sequence[dict[str, Any]]):
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]  # by int index only, as grain reads a source
        example = self._source[index]
        return {"image": example["image"], "label": example["label"]}


class TokenWindows(Sequence):
    """Consecutive windows of `seq_len + 1` tokens over one long token array.

    Window i starts at token i * seq_len, so each target token is predicted exactly once per
    epoch: the last token of one window is the first of the next.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self._tokens = tokens
        self._seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self._tokens) - 1) // self._seq_len)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:  # type: ignore[override]  # by int index only, as grain reads a source
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self._seq_len
        return {"tokens": self._tokens[start : start + self._seq_len + 1]}


def text_bytes(source: Sequence[dict[str, Any]], key: str = "text") -> np.ndarray:
    """All examples' texts of a split, joined, as a uint8 array of UTF-8 bytes (the tokens)."""
    pieces = []
    for i in range(len(source)):
        text = source[i][key]
        pieces.append(text.encode("utf-8") if isinstance(text, str) else bytes(text))
    return np.frombuffer(b"".join(pieces), dtype=np.uint8)
