"""Prepare a dataset for offline use: `python -m jamp.train.data NAME [--data_dir DIR]`."""

import argparse
import logging
import os
import sys

from jamp.train.data import DATASETS, DataError, prepare

# tfds's warnings that are noise here, as in `python -m jamp.train`: a dataset about to be written
# has no info file yet; OpenCV would decode images faster than Pillow (which is fast enough).
_NOISE = ("has no dataset_info.json", "OpenCV is not installed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jamp.train.data", description=__doc__)
    parser.add_argument("name", choices=sorted(DATASETS))
    parser.add_argument(
        "--data_dir", default=None, help="default: $TFDS_DATA_DIR or ~/tensorflow_datasets"
    )
    args = parser.parse_args(argv)
    logging.getLogger("absl").addFilter(lambda r: not any(n in r.getMessage() for n in _NOISE))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's start-up banners, if used
    try:
        print(f"'{args.name}' is ready in {prepare(args.name, args.data_dir)}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
