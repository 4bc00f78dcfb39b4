"""A small decoder-only Transformer language model on tiny_shakespeare (characters), bf16 compute.

python -m jamp.train --config=configs/lm_tiny_shakespeare.py
python -m jamp.train --config=configs/lm_tiny_shakespeare.py --config.policy=mixed_float16
python -m jamp.train --config=configs/lm_tiny_shakespeare.py:smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.model = "transformer_lm"
    c.model_config.num_layers = 4
    c.model_config.d_model = 256
    c.model_config.num_heads = 4
    c.model_config.mlp_dim = 1024
    c.model_config.dropout_rate = 0.1
    c.dataset = "tiny_shakespeare"
    c.seq_len = 128
    c.policy = "mixed_bfloat16"
    c.batch_size = 32
    c.num_train_steps = 3000
    c.optimizer = "adamw"
    c.learning_rate = 1e-3
    c.schedule = "warmup_cosine"
    c.warmup_steps = 200
    c.weight_decay = 0.01
    c.max_grad_norm = 1.0
    c.log_every_steps = 100
    c.eval_every_steps = 1000
    c.checkpoint_every_steps = 1000
    c = _default["_variant"](c, variant)
    if variant == "smoke":
        c.model_config.update(num_layers=1, d_model=32, num_heads=2, mlp_dim=64)
        c.seq_len = 16
        c.batch_size = 8
        c.warmup_steps = 2
    return c
