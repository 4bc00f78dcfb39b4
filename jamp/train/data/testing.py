"""Test helper: tfds datasets as random examples of their real features, offline."""

import contextlib
from unittest import mock


@contextlib.contextmanager
def mock_tfds(num_examples: int = 16):
    """`tfds.testing.mock_data` (USE_CODE) for code that opens datasets through `jamp.train.data`.

    Inside, every tfds dataset looks absent but downloadable: tfds's download becomes a no-op
    and its data source yields `num_examples` random examples per split. The download-host check
    that makes real offline downloads fail fast is switched off, since nothing is downloaded, and
    so is the check for TensorFlow, which mocked data does not need.
    """
    import tensorflow_datasets as tfds

    from jamp.train.data import tfds_sources

    policy = tfds.testing.MockPolicy.USE_CODE
    with (
        tfds.testing.mock_data(num_examples=num_examples, policy=policy),
        mock.patch.object(tfds_sources, "unreachable_host", return_value=None),
        mock.patch.object(tfds_sources, "tensorflow_installed", return_value=True),
    ):
        yield
