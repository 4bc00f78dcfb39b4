"""The offline default dataset: scikit-learn's handwritten digits as a real tfds dataset.

scikit-learn ships the 1,797 8x8 digits (UCI "optdigits" test set, pixel counts 0..16) inside its
wheel, so this dataset builds without any network. It is an ordinary `GeneratorBasedBuilder`
written in `array_record`, so that it is read through exactly the same `tfds` random-access path as
MNIST or CIFAR-10. Neither writing nor reading it needs TensorFlow: the examples are handed to tfds
as PNG bytes that Pillow encodes (given a numpy image, tfds would encode it with TensorFlow), and
tfds decodes them with Pillow. The PNG bytes differ from TensorFlow's, the pixels do not: a
directory prepared either way reads the same.
"""

import io

import numpy as np
import tensorflow_datasets as tfds

from jamp.train.data.tfds_sources import LocalBuilder

NAME = "jamp_digits"
NUM_TEST_PER_CLASS = 30  # 300 test examples, 30 of each digit; the other 1,497 train
_SPLIT_SEED = 20240607  # fixed forever: changing it changes the dataset (bump VERSION then)


def _load_images_and_labels() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as uint8 (N, 8, 8, 1) images scaled 0..16 -> 0..255, and int labels."""
    from sklearn.datasets import load_digits  # only preparing needs scikit-learn

    digits = load_digits()
    counts = digits.images.astype(np.float64)  # (N, 8, 8), integers 0..16
    images = np.rint(counts * (255.0 / 16.0)).astype(np.uint8)[..., None]
    return images, digits.target.astype(np.int64)


def split_indices(labels: np.ndarray) -> dict[str, np.ndarray]:
    """A stratified, seeded train/test split: `NUM_TEST_PER_CLASS` of every class go to test."""
    rng = np.random.default_rng(_SPLIT_SEED)
    per_class = []
    for cls in range(10):
        members = np.flatnonzero(labels == cls)
        per_class.append(rng.permutation(members)[:NUM_TEST_PER_CLASS])
    test = np.sort(np.concatenate(per_class))
    train = np.setdiff1d(np.arange(len(labels)), test)
    return {"train": train, "test": test}


def encode_png(image: np.ndarray) -> bytes:
    """A uint8 (H, W, 1) image as PNG bytes (8-bit grayscale, mode "L"), encoded with Pillow."""
    from PIL import Image  # only preparing encodes

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image[..., 0], dtype=np.uint8)).save(buffer, "png")
    return buffer.getvalue()


class Digits(LocalBuilder):
    """scikit-learn's 8x8 handwritten digits, split 1,497 train / 300 test (stratified)."""

    name = NAME
    SOURCE = "scikit-learn's copy of the digits"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First release: 8x8x1 uint8 images, 10 classes, train and test."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Handwritten digits (UCI optdigits) as shipped inside scikit-learn, pixel "
                "counts 0..16 scaled to 0..255."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://scikit-learn.org/stable/datasets/toy_dataset.html",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download: the data is inside scikit-learn
        images, labels = _load_images_and_labels()
        return {
            split: self._generate_examples(images, labels, indices)
            for split, indices in split_indices(labels).items()
        }

    def _generate_examples(self, images, labels, indices):
        for i in indices:  # the key is the index in scikit-learn's array: stable and unique
            yield int(i), {"image": encode_png(images[i]), "label": int(labels[i])}
