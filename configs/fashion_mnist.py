"""The seed CNN on Fashion-MNIST (28x28 clothing images), one epoch, as in the seed recipe.

python -m jamp.train --config=configs/fashion_mnist.py                 # downloads Fashion-MNIST once
python -m jamp.train --config=configs/fashion_mnist.py --config.data_dir=/data/tfds
python -m jamp.train --config=configs/fashion_mnist.py:smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.dataset = "fashion_mnist"
    c.num_train_steps = 938  # one epoch of 60,000 images at batch 64
    c.eval_every_steps = 469
    c.checkpoint_every_steps = 469
    return _default["_variant"](c, variant)
