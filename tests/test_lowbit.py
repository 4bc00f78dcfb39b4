"""jamp.lowbit: optimizer state in bfloat16 and in 8 bits (block-wise dynamic quantisation):
the error bound, training alongside float32 state, sharding, checkpoints, bytes per parameter."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from toy import MLP, make_batch, make_loss_fn

from jamp import lowbit, placement, rounding, sharding
from jamp.lowbit import bytes_per_param
from jamp.models import TransformerLM
from jamp.state import TrainState
from jamp.step import make_train_step
from jamp.wrap import wrap

KEY = jax.random.key(0)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("width", [700, 701])  # 4 blocks of 175; 3 of 256, the last padded
def test_8bit_codes_are_the_nearest_and_their_error_is_bounded(signed, width):
    code = lowbit.dynamic_code(signed)
    assert code.shape == (256,) and np.all(np.diff(code) >= 0)
    assert (code.min(), code.max()) == ((-1.0, 1.0) if signed else (1e-8, 1.0))
    count, size = lowbit.block_layout(width, 256)
    assert (count, size) == ((4, 175) if width == 700 else (3, 256))  # 701: odd
    # values over 8 decades, a block of zeros
    x = jax.random.normal(KEY, (6, width)) * jnp.logspace(-8, 0, width)
    x = x.at[2].set(0.0)
    x = x if signed else jnp.abs(x)
    q = lowbit.quantize(x, signed=signed, block=256)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == x.shape and q.scales.shape == (6, count)
    got = np.asarray(lowbit.dequantize(q))
    blocks = np.pad(np.asarray(x), [(0, 0), (0, count * size - width)]).reshape(6, count, size)
    scales = np.abs(blocks).max(-1)
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    normalised = blocks / np.where(scales > 0, scales, 1)[..., None]
    nearest = np.abs(normalised[..., None] - code).argmin(-1).reshape(6, -1)[:, :width]
    np.testing.assert_array_equal(code[np.asarray(q.codes)], code[nearest])
    # the bound: half the widest gap between codes, times the block's scale (1/128 of the
    # block's largest value signed, 1/256 unsigned); a block's largest value is exact
    scale = np.repeat(scales, size, -1)[:, :width]
    half_gap = np.diff(code).max() / 2
    assert half_gap <= (0.9 / 64 / 2 if signed else 0.9 / 128 / 2) + 1e-7
    assert np.all(np.abs(got - np.asarray(x)) <= half_gap * scale * (1 + 1e-6))
    peaks = np.argmax(np.abs(blocks), -1)
    for r in (0, 1, 3):
        for b in range(count):
            v = blocks[r, b, peaks[r, b]]
            assert got[r, b * size + peaks[r, b]] == pytest.approx(v, rel=1e-6)
    assert np.all(got[2] == 0)  # an all-zero block stays zero


def test_8bit_blocks_tile_power_of_two_shards():
    # (blocks, values per block): whole blocks per shard for any power-of-two split of the row
    # (Llama-2-7B's mlp 11008 and vocabulary 32000), else padded blocks of 256
    assert lowbit.block_layout(11008, 256) == (64, 172)
    assert lowbit.block_layout(32000, 256) == (128, 250)
    assert lowbit.block_layout(4096, 256) == (16, 256)
    assert lowbit.block_layout(64, 256) == (1, 64)
    assert lowbit.block_layout(50257, 256) == (197, 256)  # a prime: padded


def test_an_unsigned_code_never_rounds_a_positive_value_to_zero():
    # Adam's second moment divides the update: rounded to 0, an update would be m / epsilon
    x = jnp.array([1.0, 1e-9, 1e-12, 0.0] + [0.5] * 252, jnp.float32)
    got = lowbit.dequantize(lowbit.quantize(x, signed=False))
    assert np.all(np.asarray(got[:4]) > 0) and float(got[0]) == 1.0


def _train(tx, steps=150, policy="float32"):
    model = wrap(MLP(), policy)
    batch = make_batch(64)
    params = model.init(jax.random.key(1), batch["x"])["params"]
    state = TrainState.create(params, tx)
    step = jax.jit(make_train_step(make_loss_fn(model), tx))
    for _ in range(steps):
        state, metrics = step(state, batch, KEY)
    return state, float(metrics["loss"])


def test_adam_with_low_bit_state_trains_like_float32_state():
    _, ref = _train(optax.adam(3e-2))
    bf16_state, bf16 = _train(lowbit.bf16_state(optax.adam(3e-2)))
    int8_state, int8 = _train(lowbit.int8_state(optax.adam(3e-2), min_size=8))
    inner = int8_state.opt_state.inner[0]
    assert isinstance(inner.mu["Dense_0"]["kernel"], lowbit.Quantized)
    assert not inner.nu["Dense_0"]["kernel"].signed and inner.mu["Dense_0"]["kernel"].signed
    assert {x.dtype for x in jax.tree.leaves(bf16_state.opt_state.inner[0].mu)} == {
        jnp.dtype(jnp.bfloat16)
    }
    assert int(bf16_state.opt_state.step) == 150
    start = _train(optax.adam(3e-2), steps=1)[1]  # the loss before any update
    # all three fall by orders of magnitude; the low-bit ones land where float32 state does
    assert ref < 1e-3 * start
    assert abs(np.log(bf16 / ref)) < np.log(3) and abs(np.log(int8 / ref)) < np.log(3)


def _lm_state(tx, policy="mixed_bfloat16,params=bf16", d=256, abstract=False):
    model = wrap(
        TransformerLM(vocab_size=256, num_layers=2, d_model=d, num_heads=4, mlp_dim=4 * d),
        policy,
    )
    tokens = jnp.zeros((2, 16), jnp.int32)

    def init():
        return TrainState.create(model.init(jax.random.key(2), tokens)["params"], tx)

    return jax.eval_shape(init) if abstract else init(), model


def test_bytes_per_parameter_of_each_choice():
    adam = optax.adamw(1e-3)
    got = {}
    for name, policy, tx in [
        ("fp32 master", "mixed_bfloat16", adam),
        ("bf16 + bf16 state", "mixed_bfloat16,params=bf16", lowbit.bf16_state(adam)),
        ("bf16 + 8-bit state", "mixed_bfloat16,params=bf16", lowbit.int8_state(adam)),
    ]:
        got[name] = bytes_per_param(_lm_state(tx, policy, abstract=True)[0])
    assert got["fp32 master"]["total"] == pytest.approx(12.0, abs=1e-3)
    assert got["bf16 + bf16 state"]["total"] == pytest.approx(6.0, abs=1e-3)
    assert got["bf16 + 8-bit state"]["params"] == 2.0
    assert got["bf16 + 8-bit state"]["total"] <= 4.1  # target: 4.5


def _moments(opt_state):
    quantized = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, lowbit.Quantized))
    return [np.asarray(lowbit.dequantize(q)) for q in quantized if isinstance(q, lowbit.Quantized)]


class Wide(nn.Module):
    """Kernels (256, 64) (Dense_0: flax names the outer call's module first) and (64, 256):
    8-bit moments in blocks across rows, and of a row."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(64)(nn.relu(nn.Dense(256)(x)))


def test_8bit_moments_of_a_split_row_quantise_where_they_lie():
    """A (16, 11008) moment split on its last axis (fsdp=8: 1376 values a device) quantises
    and dequantises with no collective: its 64 blocks of 172 lie whole on each device (blocks
    of 256 would straddle the shards, and the partitioner would gather the whole float32 row)."""
    mesh = sharding.make_mesh("fsdp=8")
    split = jax.sharding.NamedSharding(mesh, P(None, "fsdp"))
    x = jax.device_put(jax.random.normal(KEY, (16, 11008)), split)

    def roundtrip(x):
        q = lowbit.quantize(x, signed=True)
        return lowbit.dequantize(q), q.scales

    text = jax.jit(roundtrip, in_shardings=split).lower(x).compile().as_text()
    assert not any(c in text for c in ("all-gather", "all-to-all", "all-reduce", "permute"))
    got, scales = jax.jit(roundtrip)(x)
    assert scales.shape == (16, 64)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(roundtrip(np.asarray(x))[0]))


def test_8bit_state_is_split_like_its_param_and_checkpoints(tmp_path):
    from jamp.train.checkpoint import Checkpointer

    tx = lowbit.int8_state(optax.adam(1e-3))
    model = wrap(Wide(), "mixed_bfloat16,params=bf16")
    x = jax.random.normal(KEY, (16, 64))
    batch = {"x": x, "y": x[:, 0]}
    state = TrainState.create(model.init(jax.random.key(2), x)["params"], tx)
    mesh = sharding.make_mesh("fsdp=8")
    placed = sharding.shard_state(state, mesh)
    inner = placed.opt_state.inner[0]
    for moment in (inner.mu, inner.nu):
        # (64, 256): split on its last axis; blocks of a row, one scale per row, not split
        q, param = moment["Dense_1"]["kernel"], placed.params["Dense_1"]["kernel"]
        assert q.codes.sharding.spec == param.sharding.spec == P(None, "fsdp")
        assert q.scales.shape == (64, 1) and q.scales.sharding.spec == P()
        # (256, 64): blocks span 4 rows, 64 scales split with the rows
        q, param = moment["Dense_0"]["kernel"], placed.params["Dense_0"]["kernel"]
        assert q.codes.sharding.spec == param.sharding.spec == P("fsdp")
        assert q.scales.shape == (64,) and q.scales.sharding.spec == P("fsdp")
    assert "per parameter: params 2.00 + optimizer" in placement.describe(placed)

    step = make_train_step(make_loss_fn(model), tx)
    p_step = sharding.make_sharded_train_step(step, mesh, sharding.state_shardings(placed))
    j_step = jax.jit(step)
    single = state
    for _ in range(2):
        placed, _ = p_step(placed, sharding.shard_batch(batch, mesh), KEY)
        single, _ = j_step(single, batch, KEY)
    # the sharded step's moments are the single device's, but for another summation order
    for a, b in zip(_moments(placed.opt_state), _moments(single.opt_state)):
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, single)
        restored = ckpt.restore(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(single)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_kahan_carries_what_rounding_to_nearest_loses_and_lands_on_bfloat16_values():
    """Updates of 1/20 of a bfloat16 ulp, 100 times: to nearest alone nothing moves
    (tests/test_rounding.py); with Kahan's compensation every weight moves by the float32 sum
    to within one bfloat16 ulp, deterministically, and either step rounding changes nothing."""
    start = jnp.linspace(1.0, 2.0, 512, dtype=jnp.float32).astype(jnp.bfloat16)
    delta = 2.0**-7 / 20
    tx = lowbit.kahan(optax.sgd(1.0))
    params = {"w": start}
    state = tx.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
    assert state.compensation["w"].dtype == jnp.bfloat16
    for i in range(100):
        p32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        updates, state = tx.update({"w": jnp.full(512, -delta)}, state, p32)
        new32 = optax.apply_updates(p32, updates)
        key = jax.random.key(i)
        params = rounding.round_tree(new32, params, "nearest", key)
        stochastic = rounding.round_tree(new32, params, "stochastic", key)
        np.testing.assert_array_equal(  # lands on bfloat16 values: nothing left to round
            np.asarray(new32["w"]), np.asarray(stochastic["w"], np.float32)
        )
    moved = np.asarray(params["w"], np.float32) - np.asarray(start, np.float32)
    ulp = np.asarray(jnp.ones(512) * 2.0**-7) * np.where(np.asarray(start) >= 2, 2, 1)
    assert np.all(np.abs(moved - 100 * delta) <= ulp)
    assert abs(moved.mean() - 100 * delta) < 0.05 * 100 * delta


def test_signs_follow_state_field_names_and_kahan_moves_scalar_params():
    # a param named "nu" is not a second moment: only NamedTuple fields decide
    params = {"nu": jnp.ones((64, 128)), "s": jnp.ones((), jnp.float32)}
    state = lowbit.int8_state(optax.adam(1e-3)).init(params)
    assert state.inner[0].mu["nu"].signed and not state.inner[0].nu["nu"].signed
    amsgrad = lowbit.int8_state(optax.amsgrad(1e-3)).init(params)
    assert not amsgrad.inner[0].nu_max["nu"].signed
    # Kahan compensates 0-d params too
    tx = lowbit.kahan(optax.sgd(1.0))
    p = {"s": jnp.ones((), jnp.bfloat16)}
    st = tx.init({"s": jnp.ones((), jnp.float32)})
    for _ in range(40):
        u, st = tx.update({"s": jnp.float32(-(2.0**-12))}, st, {"s": p["s"].astype(jnp.float32)})
        p = {"s": (p["s"].astype(jnp.float32) + u["s"]).astype(jnp.bfloat16)}
    assert float(p["s"]) == 1.0 + 40 * 2.0**-12 - (40 * 2.0**-12) % 2.0**-7
