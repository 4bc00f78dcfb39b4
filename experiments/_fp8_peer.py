"""The Flax peer of jamp's fp8 policy: `flax.linen.fp8_ops` on the LM recipe, trained by hand.

A peer variant of jamp.models.TransformerLM (the same module structure, parameter names and sizes)
written the way a Flax user does fp8: every layer computes in bfloat16 (``dtype=bfloat16,
param_dtype=float32``, as in peers_flax.HandLM) and the layer matmuls, the MLP's two Dense layers
and the attention's q, k, v and output projections, get flax's fp8 op as their
``dot_general_cls`` (E4M3 operands, E5M2 output gradient, delayed scaling from an amax history).
The embedding lookup, the tied output head (``embed.attend``) and the two attention einsums stay
bfloat16: the same matmuls jamp's mixed_fp8 leaves out of fp8.

Flax keeps each fp8 op's scales and amax histories as variables in the ``_overwrite_with_gradient``
collection: their "gradient" is their new value. The train step below takes the gradient with
respect to ``{"params", "_overwrite_with_gradient"}``, clips only the params' part, and hands both
to flax's own `TrainState.apply_gradients`, which runs the optimizer on the params and replaces the
fp8 variables by their "gradients"; the optimizer never sees them.

Everything else is the training program's: the config (configs/lm_pydoc.py with the same command
line overrides, parsed by `jamp.train.run_config.parse_config`), the dataset (`jamp.train.loop.build_model`,
hence `jamp.train.data.get_dataset`: the same batches in the same order), the initial parameters (the
program's `jamp.train.loop.init_state`), the optimizer and schedule (`jamp.train.optim.make_optimizer`), the
gradient clipping (global norm of the params' gradient), the skip of a non-finite step, the loss
and the eval (`jamp.train.tasks`). It writes `metrics.jsonl` like the program (train windows of
`--log_every` steps, eval at the recipe's eval_every_steps and at the end), so the accuracy script
reads both alike.

    python experiments/_fp8_peer.py --workdir /tmp/peer --seed 0            # flax fp8_ops
    python experiments/_fp8_peer.py --workdir /tmp/peer_bf16 --dot bf16     # the same, no fp8
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import runpy
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import fp8_ops
from flax.training import train_state

from jamp.train import loop, tasks
from jamp.train.optim import make_optimizer
from jamp.train.run_config import parse_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "lm_pydoc.py"
F32 = jnp.float32
BF16 = jnp.bfloat16
OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
#: --dot: flax's fp8 op for the layer matmuls, or none (plain bfloat16, the peer's own reference).
DOTS = ("fp8", "bf16")


def fp8_dot_cls(history: int):
    """Flax's fp8 dot_general op with an amax history of `history` steps (flax's default: 1024)."""
    return functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=history)


class PeerDecoderBlock(nn.Module):
    """jamp.models.transformer.DecoderBlock (no dropout) in bf16, layer matmuls by `dot_cls`."""

    num_heads: int
    mlp_dim: int
    dot_cls: object = None  # None: lax.dot_general in bf16

    @nn.compact
    def __call__(self, x, mask):
        hand = dict(dtype=BF16, param_dtype=F32)
        dense = dict(dot_general_cls=self.dot_cls) if self.dot_cls else {}
        attn = dict(qkv_dot_general_cls=self.dot_cls, out_dot_general_cls=self.dot_cls)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            deterministic=True,
            **hand,
            **(attn if self.dot_cls else {}),
        )(nn.LayerNorm(**hand)(x), mask=mask)
        x = x + y
        y = nn.Dense(self.mlp_dim, **hand, **dense)(nn.LayerNorm(**hand)(x))
        y = nn.Dense(x.shape[-1], **hand, **dense)(nn.gelu(y))
        return x + y


class PeerLM(nn.Module):
    """jamp.models.transformer.TransformerLM's structure and names, bf16 compute, fp32 logits."""

    vocab_size: int
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    mlp_dim: int = 1024
    max_len: int = 1024
    dropout_rate: float = 0.0
    dot_cls: object = None

    @nn.compact
    def __call__(self, tokens_BL, train: bool = False):
        if self.dropout_rate:
            raise ValueError("the fp8 peer has no dropout (the LM recipe sets dropout_rate 0)")
        hand = dict(dtype=BF16, param_dtype=F32)
        embed = nn.Embed(self.vocab_size, self.d_model, **hand)
        positions = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model)
        )
        x = embed(tokens_BL) + positions[: tokens_BL.shape[1]].astype(BF16)
        mask = nn.make_causal_mask(tokens_BL)
        for i in range(self.num_layers):  # named like jamp.models' DecoderBlock_i
            x = PeerDecoderBlock(
                self.num_heads, self.mlp_dim, self.dot_cls, name=f"DecoderBlock_{i}"
            )(x, mask)
        x = nn.LayerNorm(**hand)(x)
        return embed.attend(x).astype(F32)  # tied output head: bf16, not fp8 (as in jamp)


def program_config(seed: int, steps: int, warmup: int, data_dir: str):
    """configs/lm_pydoc.py with the overrides accuracy_fp8.py gives the program's runs."""
    config = runpy.run_path(str(CONFIG))["get_config"]()
    config.seed = seed
    config.num_train_steps = steps
    config.warmup_steps = warmup
    config.policy = "mixed_bfloat16"  # only for parse_config's checks: the peer does its own
    if data_dir:
        config.data_dir = data_dir
    return config


def fp8_sites(variables) -> list[str]:
    """The module paths holding a flax fp8 op's variables, in tree order."""
    flat = jax.tree_util.tree_flatten_with_path(variables.get(OWG, {}))[0]
    paths = ["/".join(k.key for k in path[:-1]) for path, _ in flat]
    return list(dict.fromkeys(paths))


def site_metrics(owg, site: str) -> dict:
    """The site's newest amax and its scale per operand, in jamp's convention (q = x * scale).

    Flax quantises with q = x / s, so jamp's scale is 1 / s; rows x (input), w (kernel) and g
    (output gradient) as in jamp's metrics.jsonl."""
    node = owg
    for key in site.split("/"):
        node = node[key]
    out = {}
    for row, name in (("x", "input"), ("w", "kernel"), ("g", "output_grad")):
        out[f"fp8/{site}/{row}_amax"] = node[f"{name}_amax_history"][0]
        out[f"fp8/{site}/{row}_scale"] = 1.0 / node[f"{name}_scale"][0]
    return out


def make_train_step(loss_fn, max_grad_norm, site):
    """A jitted `(state, batch, rng) -> (state, metrics)` for flax's TrainState."""

    def step(state, batch, rng):
        def loss(variables):
            model_state = {k: v for k, v in variables.items() if k != "params"}
            return loss_fn(variables["params"], model_state, batch, rng)

        (value, (_, metrics)), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        # grads[OWG] are not gradients but the fp8 ops' new scales and amax histories: they are
        # neither clipped, nor counted in the norm, nor seen by the optimizer.
        norm = optax.tree.norm(grads["params"])
        finite = jnp.all(
            jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads["params"])])
        )
        if max_grad_norm:
            factor = max_grad_norm / jnp.maximum(norm, max_grad_norm)  # as jamp.step clips
            grads = dict(grads, params=jax.tree.map(lambda g: g * factor, grads["params"]))
        new = state.apply_gradients(grads=grads)
        # A non-finite step leaves the state as it was (as jamp's step does), fp8 variables too.
        new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
        metrics = dict(metrics, loss=value, grad_norm=norm, grads_finite=finite.astype(F32))
        if site is not None:
            metrics.update(site_metrics(new.params[OWG], site))
        return new, metrics

    return jax.jit(step, donate_argnums=0)


def evaluate(eval_step, variables, dataset) -> dict:
    totals = None
    for batch in dataset.eval_batches():
        sums = jax.device_get(eval_step(variables, batch))
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    return tasks.summarize_eval("lm", totals)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--history", type=int, default=16, help="amax history (flax: 1024)")
    parser.add_argument("--dot", choices=DOTS, default="fp8")
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--data_dir", default="")
    args = parser.parse_args(argv)

    config = program_config(args.seed, args.steps, args.warmup, args.data_dir)
    run, data_cfg, optim_cfg, task = parse_config(config)
    dataset, jamp_model = loop.build_model(run, data_cfg, task)
    tx, schedule = make_optimizer(optim_cfg)
    # The program's initial parameters (same seed: same init as its runs).
    params = loop.init_state(jamp_model, tx, run.loss_scale, dataset.info, run.seed).params

    dot_cls = fp8_dot_cls(args.history) if args.dot == "fp8" else None
    model = PeerLM(vocab_size=dataset.info.num_classes, dot_cls=dot_cls, **run.model_config)
    dummy = jnp.zeros((1, *dataset.info.input_shape), jnp.int32)
    variables = dict(model.init(jax.random.key(run.seed), dummy, train=False))
    shapes = functools.partial(jax.tree.map, lambda a: (a.shape, a.dtype))
    if shapes(variables["params"]) != shapes(dict(params)):
        raise SystemExit("the peer's parameters differ from jamp's TransformerLM's")
    variables["params"] = params
    sites = fp8_sites(variables)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)

    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    facts = dict(vars(args), peer="flax.linen.fp8_ops.Fp8DirectDotGeneralOp", fp8_sites=sites)
    (workdir / "peer.json").write_text(json.dumps(facts, indent=2) + "\n")
    site = sites[0] if sites else None
    train_step = make_train_step(tasks.make_loss_fn(model, task), run.max_grad_norm, site)
    eval_fn = tasks.make_eval_fn(model, task)
    eval_step = jax.jit(lambda v, b: eval_fn(v["params"], {k: x for k, x in v.items()
                                                          if k != "params"}, b))  # fmt: skip
    rng = jax.random.key(run.seed)
    batches = dataset.train_batches(0)
    window, finite, t0 = [], [], time.perf_counter()
    with open(workdir / "metrics.jsonl", "w") as log:

        def write(record):
            log.write(json.dumps(record) + "\n")
            log.flush()

        for step in range(1, run.num_train_steps + 1):
            state, metrics = train_step(state, next(batches), rng)
            finite.append(metrics["grads_finite"])
            if step > 1:  # as the program does, the first step (it compiles) is in no window
                window.append(metrics)
            if step % args.log_every == 0 or step == run.num_train_steps:
                window = jax.device_get(window)
                skipped = int(sum(1 - f for f in jax.device_get(finite)))
                record = {k: float(np.mean([m[k] for m in window])) for k in window[0]}
                record.update(
                    step=step,
                    kind="train",
                    skipped_steps=skipped,
                    learning_rate=float(schedule(step)),
                )
                write(record)
                window = []
            if step % run.eval_every_steps == 0 or step == run.num_train_steps:
                final = evaluate(eval_step, state.params, dataset)
                write(dict(final, step=step, kind="eval"))
        seconds = time.perf_counter() - t0
        if dot_cls is not None:
            # The fp8-trained params with plain bf16 matmuls: what fp8 did to the weights alone.
            plain = model.clone(dot_cls=None)
            plain_fn = tasks.make_eval_fn(plain, task)
            plain_step = jax.jit(lambda v, b: plain_fn(v["params"], {}, b))
            params = {"params": state.params["params"]}
            write(dict(evaluate(plain_step, params, dataset), step=step, kind="eval_bf16"))
    print(f"peer ({args.dot}, {len(sites)} fp8 ops): test loss {final['loss']:.4f} after "
          f"{run.num_train_steps} steps, {skipped} skipped, {seconds:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
