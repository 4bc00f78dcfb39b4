"""A small byte-level Transformer LM on CPython's pydoc help texts: offline, bf16 compute.

The data ships with every Python ("pydoc": about 420 KB train / 46 KB test of English help text,
split by topic, prepared once as a tfds dataset), so this recipe needs no download. 600 steps of
32 x 128 bytes (about 6 epochs) take 1-2 minutes on a 2-core CPU and bring the test loss from
ln 256 = 5.5 to about 1.6 nats per byte (2.3 bits).

python -m jamp.train --config=configs/lm_pydoc.py
python -m jamp.train --config=configs/lm_pydoc.py --config.policy=mixed_float16
python -m jamp.train --config=configs/lm_pydoc.py:smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.model = "transformer_lm"
    c.model_config.num_layers = 2
    c.model_config.d_model = 128
    c.model_config.num_heads = 4
    c.model_config.mlp_dim = 512
    c.model_config.dropout_rate = 0.0  # ~6 epochs of the data: too few to overfit
    c.dataset = "pydoc"
    c.seq_len = 128
    c.policy = "mixed_bfloat16"
    c.batch_size = 32
    c.num_train_steps = 600
    c.optimizer = "adamw"
    c.learning_rate = 2e-3
    c.schedule = "warmup_cosine"
    c.warmup_steps = 60
    c.weight_decay = 0.01
    c.max_grad_norm = 1.0
    c.log_every_steps = 50
    c.eval_every_steps = 200
    c.checkpoint_every_steps = 600
    c = _default["_variant"](c, variant)
    if variant == "smoke":
        c.model_config.update(num_layers=1, d_model=32, num_heads=2, mlp_dim=64)
        c.seq_len = 16
        c.batch_size = 8
        c.warmup_steps = 2
    return c
