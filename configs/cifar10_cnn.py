"""The seed document's example: its small CNN on CIFAR-10 with Adam (lr 1e-3), batch 64, one epoch.

python -m jamp.train --config=configs/cifar10_cnn.py                 # downloads CIFAR-10 once
python -m jamp.train --config=configs/cifar10_cnn.py --config.data_dir=/data/tfds
python -m jamp.train --config=configs/cifar10_cnn.py:smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.dataset = "cifar10"
    c.num_train_steps = 782  # one epoch of 50,000 images at batch 64
    c.eval_every_steps = 391
    c.checkpoint_every_steps = 391
    return _default["_variant"](c, variant)
