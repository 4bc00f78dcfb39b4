"""The default recipe with the seed CNN written in Flax NNX: digits, fp16 with a dynamic loss scale.

The model is `jamp.models.nnx_models.SeedCNN` (model "seed_cnn_nnx"), run through `jamp.wrap`'s
NNX path; the policy is chosen by the same flag as for linen models.

python -m jamp.train --config=digits_nnx
python -m jamp.train --config=digits_nnx --config.policy=mixed_bfloat16
python -m jamp.train --config=digits_nnx:smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.model = "seed_cnn_nnx"
    return _default["_variant"](c, variant)
