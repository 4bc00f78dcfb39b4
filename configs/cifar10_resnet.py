"""A CIFAR ResNet-20 with batch norm on CIFAR-10: Nesterov SGD, warmup + cosine, bf16 compute.

python -m jamp.train --config=configs/cifar10_resnet.py
python -m jamp.train --config=configs/cifar10_resnet.py --config.policy=mixed_float16
python -m jamp.train --config=configs/cifar10_resnet.py:smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.model = "resnet20"
    c.dataset = "cifar10"
    c.policy = "mixed_bfloat16"
    c.batch_size = 128
    c.num_train_steps = 11_730  # 30 epochs of 50,000 images
    c.optimizer = "momentum"
    c.learning_rate = 0.1
    c.schedule = "warmup_cosine"
    c.warmup_steps = 390
    c.weight_decay = 5e-4
    c.log_every_steps = 100
    c.eval_every_steps = 1955
    c.checkpoint_every_steps = 1955
    c = _default["_variant"](c, variant)
    if variant == "smoke":
        c.model_config.num_filters = 4
        c.batch_size = 16
        c.warmup_steps = 2
    return c
