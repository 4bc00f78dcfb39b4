"""``python -m jamp.train``: see jamp/train/cli.py."""

from jamp.train.cli import run

run()
