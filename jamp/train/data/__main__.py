"""Prepare a dataset for offline use: `python -m jamp.train.data NAME [--data_dir DIR]`."""

import argparse
import sys

from jamp.train.data import DATASETS, DataError, prepare


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jamp.train.data", description=__doc__)
    parser.add_argument("name", choices=sorted(DATASETS))
    parser.add_argument(
        "--data_dir", default=None, help="default: $TFDS_DATA_DIR or ~/tensorflow_datasets"
    )
    args = parser.parse_args(argv)
    try:
        print(f"'{args.name}' is ready in {prepare(args.name, args.data_dir)}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
