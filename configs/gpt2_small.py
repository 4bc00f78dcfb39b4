"""GPT-2 small's shape (12 x 768, 12 heads, seq 1024, vocab 50304) as jamp's TransformerLM, bf16.

Sized for a GPU: its step is what `experiments/gpu_compile.py` and the README's "Before you
rent a GPU" compile for an H200. No 50304-token data ships with jamp, so it trains on
"synthetic_tokens"; only the shapes matter when the step is compiled abstractly.

python -m jamp.train --config=gpt2_small --compile_for=h200            # memory, GEMMs, batch
python -m jamp.train --config=gpt2_small --workdir=/tmp/gpt2            # on a GPU
python -m jamp.train --config=gpt2_small:smoke                          # a few tiny steps
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))


def get_config(variant: str = ""):
    c = _default["get_config"]()
    c.model = "transformer_lm"
    c.model_config.update(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072, max_len=1024)
    c.dataset = "synthetic_tokens"
    c.vocab_size = 50304  # GPT-2's 50257, padded to a multiple of 64
    c.seq_len = 1024
    c.policy = "mixed_bfloat16"
    c.batch_size = 8
    c.num_train_steps = 5000
    c.optimizer = "adamw"
    c.learning_rate = 6e-4
    c.schedule = "warmup_cosine"
    c.warmup_steps = 200
    c.weight_decay = 0.1
    c.max_grad_norm = 1.0
    c.log_every_steps = 50
    c.eval_every_steps = 1000
    c.checkpoint_every_steps = 1000
    c = _default["_variant"](c, variant)
    if variant == "smoke":
        c.model_config.update(num_layers=1, d_model=32, num_heads=2, mlp_dim=64, max_len=16)
        c.vocab_size = 256
        c.seq_len = 16
        c.warmup_steps = 2
    return c
