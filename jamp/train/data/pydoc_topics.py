"""An offline language-modelling dataset: the English help text every CPython install carries.

`pydoc_data.topics.topics` holds the text of `help("assert")`, `help("FORMATTING")` and the other
language topics (about 465 KB of English prose and Python snippets in 79 topics, in CPython 3.11),
so this dataset builds without any network, like "digits". It is an ordinary
`GeneratorBasedBuilder` written in `array_record`, read through the same `tfds` random-access path
as tiny_shakespeare and served the same way: each split's texts joined into one stream of UTF-8
bytes, cut into windows of `seq_len + 1` byte tokens. Neither writing nor reading it needs
TensorFlow.

The split is by topic (no topic is in both), about 90 % / 10 % of the bytes, and a pure function of
the topic names and sizes. The text is that of the Python that prepares the dataset; CPython's
patch releases edit it now and then, so the Python version is recorded in the dataset's metadata.
"""

import hashlib
import platform

import tensorflow_datasets as tfds

from jamp.train.data.tfds_sources import LocalBuilder

NAME = "jamp_pydoc"
TEST_FRACTION = 0.1  # at most this share of the bytes goes to test, whole topics only
_SPLIT_SEED = "jamp_pydoc/1"  # fixed forever: changing it changes the dataset (bump VERSION then)


def load_topics() -> dict[str, str]:
    """Topic name -> help text, as this Python ships them."""
    from pydoc_data.topics import topics

    return dict(topics)


def _rank(topic: str) -> str:
    return hashlib.sha256(f"{_SPLIT_SEED}:{topic}".encode()).hexdigest()


def split_topics(topics: dict[str, str]) -> dict[str, list[str]]:
    """A seeded, deterministic split of whole topics, test holding at most `TEST_FRACTION` of bytes.

    Topics are visited in the order of a hash of their names (seeded, so neither alphabetical nor
    by size); each goes to test if it still fits under the byte budget, else to train. Both lists
    come back sorted by name.
    """
    sizes = {name: len(text.encode("utf-8")) for name, text in topics.items()}
    budget = TEST_FRACTION * sum(sizes.values())
    test, test_bytes = [], 0
    for name in sorted(sizes, key=_rank):
        if test_bytes + sizes[name] <= budget:
            test.append(name)
            test_bytes += sizes[name]
    train = [name for name in sizes if name not in set(test)]
    return {"train": sorted(train), "test": sorted(test)}


class Pydoc(LocalBuilder):
    """CPython's pydoc topic help texts, one example per topic, split by topic ~90/10 by bytes."""

    name = NAME
    SOURCE = "this Python's pydoc help texts"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First release: {'topic', 'text'} per topic, train and test."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "The help texts of CPython's pydoc topics (pydoc_data.topics), one example per "
                "topic; for byte-level language modelling."
            ),
            features=tfds.features.FeaturesDict(
                {"topic": tfds.features.Text(), "text": tfds.features.Text()}
            ),
            homepage="https://docs.python.org/3/library/pydoc.html",
            # Topics stay in the order generated (by name): a split's joined text reads like one
            # document, and the order does not hang on tfds's key hashing.
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(python_version=platform.python_version()),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download: the text is inside the Python standard library
        topics = load_topics()
        return {
            split: self._generate_examples(topics, names)
            for split, names in split_topics(topics).items()
        }

    def _generate_examples(self, topics, names):
        for name in names:  # the topic name is the key: stable and unique
            yield name, {"topic": name, "text": topics[name]}
