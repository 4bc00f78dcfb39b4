"""Synthetic images of any shape, for benchmarks and smoke runs: no dataset, no download.

python -m jamp.train --config=configs/synthetic.py --config.model=resnet20
python -m jamp.train --config=configs/synthetic.py:smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.dataset = "synthetic_images"
    c.image_shape = (32, 32, 3)
    c.num_classes = 10
    c.num_train_steps = 200
    c.eval_every_steps = 100
    c.checkpoint_every_steps = 100
    return _default["_variant"](c, variant)
