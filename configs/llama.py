"""A Llama-style decoder-only LM (jamp.models.LlamaLM) of ~1.5B or 7B parameters: bf16, FSDP.

Variants (`--config=llama:<variant>`):

  ""  / "1b5"  d_model 2048, 28 layers, 16 heads, 8 kv heads, mlp 5632, vocab 32000, seq_len 2048:
               1,452,394,496 parameters; global batch 32
  "7b"         Llama-2-7B's shapes: d_model 4096, 32 layers, 32 heads (and kv heads), mlp 11008,
               vocab 32000, seq_len 4096: 6,738,415,616 parameters; global batch 16
  "70b"        Llama-2-70B's shapes: d_model 8192, 80 layers, 64 heads, 8 kv heads, mlp 28672,
               vocab 32000, seq_len 4096: 68,976,648,192 parameters; global batch 16 (its
               float32 master weights and Adam alone, 828 GB, pass 8 H200s' usable memory)
  "smoke"      2 layers of d_model 32 (4 heads, 2 kv heads) on the offline byte-level "pydoc"
               data under pmap, 12 steps: 25-40 s on a 2-core CPU, the train loss going from 5.9 to 5.2

No 32000-token data ships with jamp, so the large variants train on "synthetic_tokens" (arithmetic
sequences a model can learn). They are sized for GPU hosts and split the state over every device
("sharded", mesh "fsdp=-1"): fp32 params, fp32 gradients and Adam's two moments take 16 B per
parameter, 108 GB at 7B, before activations. Only their shapes matter when a train step is
compiled abstractly for GPUs (`--compile_for=h200x8`).

python -m jamp.train --config=llama --workdir=/tmp/llama_1b5
python -m jamp.train --config=llama:7b --workdir=/tmp/llama_7b
python -m jamp.train --config=llama:smoke --workdir=/tmp/llama_smoke
"""

import pathlib
import runpy

_default = runpy.run_path(str(pathlib.Path(__file__).with_name("default.py")))

# variant -> (model_config, seq_len, global batch size)
_SIZES = {
    "1b5": (
        dict(num_layers=28, d_model=2048, num_heads=16, num_kv_heads=8, mlp_dim=5632),
        2048,
        32,
    ),
    "7b": (
        dict(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=32, mlp_dim=11008),
        4096,
        16,
    ),
    "70b": (
        dict(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, mlp_dim=28672),
        4096,
        16,
    ),
}
_VARIANTS = ("", "1b5", "7b", "70b", "smoke")


def get_config(variant: str = ""):
    variant = variant or ""
    if variant not in _VARIANTS:
        raise ValueError(
            f"unknown config variant {variant!r}; accepted: '', '1b5', '7b', '70b' or 'smoke'"
        )
    c = _default["get_config"]()
    model_config, c.seq_len, c.batch_size = _SIZES.get(variant, _SIZES["1b5"])
    c.model = "llama_lm"
    c.model_config.update(model_config, rope_theta=10000.0, remat="none")
    c.model_config.max_len = c.get_ref("seq_len")  # follows --config.seq_len overrides
    c.dataset = "synthetic_tokens"
    c.vocab_size = 32000
    c.policy = "mixed_bfloat16"
    c.parallelism = "sharded"
    c.mesh = "fsdp=-1"
    c.num_train_steps = 10_000
    c.optimizer = "adamw"  # Llama 2's: peak 3e-4, warmup 2000 (here scaled to the run), wd 0.1
    c.learning_rate = 3e-4
    c.schedule = "warmup_cosine"
    c.warmup_steps = 500
    c.weight_decay = 0.1
    c.max_grad_norm = 1.0
    c.log_every_steps = 10
    c.eval_every_steps = 1000
    c.checkpoint_every_steps = 1000
    if variant == "smoke":
        c = _default["_variant"](c, "smoke")
        c.model_config.update(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64)
        c.dataset = "pydoc"  # bytes: its own vocabulary of 256
        c.vocab_size = 256
        c.seq_len = 16
        c.batch_size = 8
        c.parallelism = "pmap"
        c.learning_rate = 3e-3
        c.warmup_steps = 2
        c.weight_decay = 0.01
    return c
