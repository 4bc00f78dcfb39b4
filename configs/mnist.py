"""The seed CNN on MNIST (28x28 handwritten digits), one epoch, as in the seed recipe.

python -m jamp.train --config=configs/mnist.py                 # downloads MNIST once
python -m jamp.train --config=configs/mnist.py --config.data_dir=/data/tfds
python -m jamp.train --config=configs/mnist.py:smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.dataset = "mnist"
    c.num_train_steps = 938  # one epoch of 60,000 images at batch 64
    c.eval_every_steps = 469
    c.checkpoint_every_steps = 469
    return _default["_variant"](c, variant)
