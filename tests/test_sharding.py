"""jamp.sharding: the sharded-jit step on a mesh of 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from toy import MLP, BNNet, make_batch, make_loss_fn

import jamp.copies
from jamp import sharding
from jamp.loss_scale import DynamicLossScale, loss_scale_for
from jamp.models import TransformerLM
from jamp.precision import get_policy
from jamp.state import TrainState
from jamp.step import make_train_step
from jamp.wrap import wrap

KEY = jax.random.key(0)


def _lm_setup(policy, accumulation_steps=1):
    module = TransformerLM(
        vocab_size=64, num_layers=2, d_model=32, num_heads=4, mlp_dim=64, max_len=16
    )
    model = wrap(module, policy)
    tokens = jax.random.randint(jax.random.key(1), (16, 16), 0, 64)
    params = model.init(jax.random.key(2), tokens[:2])["params"]

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        labels = batch["x"][:, 1:]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels).mean()
        return loss, (model_state, {})

    tx = optax.sgd(0.1, momentum=0.9)
    state = TrainState.create(params, tx, loss_scale=loss_scale_for(get_policy(policy)))
    step = make_train_step(loss_fn, tx, accumulation_steps=accumulation_steps)
    return state, step, {"x": tokens}


#: Megatron's tensor-parallel layout of the Transformer: the MLP's first matmul and attention's
#: q/k/v (kernels (d, heads, head_dim), biases (heads, head_dim)) split by columns / heads, the
#: second matmuls by rows; FSDP splits what the rules leave free.
_ATTENTION = "*/MultiHeadDotProductAttention_0"
MEGATRON = [
    ("*/Dense_0/kernel", (None, "tensor")),
    ("*/Dense_0/bias", ("tensor",)),
    ("*/Dense_1/kernel", ("tensor", None)),
    (f"{_ATTENTION}/out/kernel", ("tensor", None, None)),
]
for _name in ("query", "key", "value"):
    MEGATRON += [(f"{_ATTENTION}/{_name}/kernel", (None, "tensor"))]
    MEGATRON += [(f"{_ATTENTION}/{_name}/bias", ("tensor",))]


def _run_sharded(state, step, batch, mesh, steps=3):
    rules = MEGATRON if "tensor" in mesh.axis_names else None
    placed = sharding.shard_state(state, mesh, rules)
    p_step = sharding.make_sharded_train_step(step, mesh, sharding.state_shardings(placed))
    for _ in range(steps):
        placed, metrics = p_step(placed, sharding.shard_batch(batch, mesh), KEY)
    return placed, metrics, p_step


def _run_single(state, step, batch, steps=3):
    j_step = jax.jit(step)
    for _ in range(steps):
        state, metrics = j_step(state, batch, KEY)
    return state, metrics


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)])


def _assert_close(got, ref, policy, start=None):
    """float32: the round-off of another summation order. With 16-bit matmul operands such a
    difference rounds some operands the other way, so the updates (from `start`) are compared
    by norm: a real fault (a shard's loss, a missing average) moves them by O(1)."""
    got, ref = _flat(got), _flat(ref)
    if policy == "float32":
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        return
    origin = 0.0 if start is None else _flat(start)
    update = ref - origin
    assert np.linalg.norm(got - ref) <= 2e-2 * np.linalg.norm(update)


_MESHES_AND_POLICIES = [
    (mesh, policy)
    for mesh in ["fsdp=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2"]
    for policy in ["float32", "mixed_bfloat16", "mixed_float16"]
] + [("data=2,fsdp=4", "mixed_bfloat16,reduce=bf16")]


@pytest.mark.parametrize("mesh_spec,policy", _MESHES_AND_POLICIES)
def test_sharding_steps_match_single_device_steps(mesh_spec, policy):
    state, step, batch = _lm_setup(policy)
    placed, metrics, p_step = _run_sharded(state, step, batch, sharding.make_mesh(mesh_spec))
    ref, ref_metrics = _run_single(state, step, batch)
    _assert_close(placed.params, ref.params, policy, start=state.params)
    _assert_close(placed.opt_state, ref.opt_state, policy)
    assert jax.tree.map(float, placed.loss_scale) == jax.tree.map(float, ref.loss_scale)
    assert int(placed.step) == 3 and int(placed.skipped_steps) == int(ref.skipped_steps)
    # float32: round-off of another summation order. 16-bit operands: once a param differs in its
    # last fp32 bit, some operand rounds to the other 16-bit neighbour (2^-8 apart), and the loss
    # after 3 steps moves by ~1e-4 of itself (measured: 1.1e-4 with tensor=2 at JAX 0.10.0;
    # 1.2e-4 with gradients summed in bf16).
    rtol = 1e-5 if policy == "float32" else 1e-3
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=rtol)
    assert p_step._cache_size() == 1  # the second and third calls compiled nothing


@pytest.mark.parametrize(
    "policy,gathered,reduced",
    [
        ("float32", "f32", "f32"),
        ("mixed_bfloat16", "bf16", "f32"),
        ("mixed_float16", "f16", "f32"),
        ("mixed_bfloat16,reduce=bf16", "bf16", "bf16"),
    ],
)
def test_sharding_policy_decides_what_crosses_the_wire(policy, gathered, reduced):
    """Read from the partitioned program (XLA:CPU would widen 16-bit collectives afterwards):
    every weight gathered for a matmul moves in the compute dtype (cast on its shard, not after
    the gather), every weight gradient is summed across devices in the policy's reduce dtype."""
    state, step, batch = _lm_setup(policy)
    mesh = sharding.make_mesh("data=2,fsdp=4")
    placed = sharding.shard_state(state, mesh)
    p_step = sharding.make_sharded_train_step(step, mesh, sharding.state_shardings(placed))
    found = sharding.collectives(p_step, placed, sharding.shard_batch(batch, mesh), KEY)
    weights = [c for c in found if c.kind == "all-gather" and c.into_matmul]
    grads = [
        c for c in found if c.kind in ("all-reduce", "reduce-scatter") and c.from_matmul and c.shape
    ]
    kernels = [k for k in jax.tree_util.tree_flatten_with_path(state.params)[0]]
    kernels = [leaf for path, leaf in kernels if "kernel" in str(path[-1])]
    # Each of the 13 matmul weights (12 kernels and the tied output head) is gathered once, in
    # the compute dtype, for the forward and the backward (half the bytes of float32), and its
    # gradient reduced once, over fsdp and over data.
    assert len(weights) == len(kernels) + 1 and len(grads) >= len(kernels) + 1
    assert {c.dtype for c in weights} == {gathered}
    itemsize = np.dtype({"f32": np.float32, "bf16": jnp.bfloat16, "f16": np.float16}[gathered])
    sizes = [x.size for x in kernels] + [state.params["Embed_0"]["embedding"].size]
    assert sum(c.nbytes for c in weights) == sum(sizes) * itemsize.itemsize
    assert {c.dtype for c in grads} == {reduced}
    # What else is gathered is what the model reads outside matmuls, in float32 on this CPU:
    # biases, norm scales, the embedding table for its row lookup; no kernel among them.
    others = [c for c in found if c.kind == "all-gather" and not c.into_matmul]
    assert {c.dtype for c in others} <= {"f32"}
    assert not any("kernel" in c.op_name for c in others)


@pytest.mark.parametrize("mesh_spec", ["data=2,fsdp=4", "data=2,fsdp=2,tensor=2"])
def test_sharding_compute_params_sit_with_their_params_and_change_no_bit(mesh_spec):
    """The state's bfloat16 copies of the params (`compute_dtype`) are placed like their params
    (tensor rules and FSDP alike), are what the matmuls gather (16-bit, once per weight), and
    give the same steps as casting the params on their shards."""
    state, step, batch = _lm_setup("mixed_bfloat16")
    kept = state.replace(compute_params=jamp.copies.compute_copies(state.params, jnp.bfloat16))
    mesh = sharding.make_mesh(mesh_spec)
    got, got_metrics, _ = _run_sharded(kept, step, batch, mesh)
    ref, ref_metrics, _ = _run_sharded(state, step, batch, mesh)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got_metrics["loss"], ref_metrics["loss"])
    copies = jax.tree.leaves(got.compute_params)
    placed = jax.tree.leaves(
        jax.tree.map(
            lambda c, p: None if c is None else p,
            got.compute_params,
            got.params,
            is_leaf=lambda c: c is None,
        )
    )
    assert copies and [c.sharding for c in copies] == [p.sharding for p in placed]
    assert all(c.dtype == jnp.bfloat16 for c in copies)
    placed_kept = sharding.shard_state(kept, mesh, MEGATRON if "tensor" in mesh_spec else None)
    p_step = sharding.make_sharded_train_step(step, mesh, sharding.state_shardings(placed_kept))
    found = sharding.collectives(p_step, placed_kept, sharding.shard_batch(batch, mesh), KEY)
    weights = [c for c in found if c.kind == "all-gather" and c.into_matmul]
    assert weights and {c.dtype for c in weights} == {"bf16"}


def test_sharding_gradient_accumulation_matches_single_device():
    state, step, batch = _lm_setup("mixed_bfloat16", accumulation_steps=2)
    placed, _, _ = _run_sharded(state, step, batch, sharding.make_mesh("data=2,fsdp=4"))
    ref, _ = _run_single(state, step, batch)
    _assert_close(placed.params, ref.params, "mixed_bfloat16", start=state.params)


def test_sharding_batch_stats_stay_replicated_and_match_single_device():
    model, batch = BNNet(), make_batch(size=16)
    variables = model.init(KEY, batch["x"])
    params = variables.pop("params")
    # Not Adam: the bias before a BatchNorm has a zero gradient up to round-off, which Adam would
    # turn into full-size steps of either sign.
    tx = optax.sgd(0.1, momentum=0.9)
    state = TrainState.create(params, tx, model_state=variables)
    step = make_train_step(make_loss_fn(model), tx)
    placed, _, _ = _run_sharded(state, step, batch, sharding.make_mesh("fsdp=8"))
    ref, _ = _run_single(state, step, batch)
    _assert_close(placed.model_state, ref.model_state, "float32")
    _assert_close(placed.params, ref.params, "float32")
    for leaf in jax.tree.leaves(placed.model_state):
        assert leaf.sharding.is_fully_replicated


def test_sharding_state_bytes_per_device_are_a_fsdp_share_plus_the_named_leftovers():
    state, _, _ = _lm_setup("mixed_bfloat16")
    state = TrainState.create(state.params, optax.adam(1e-3))  # Adam: moments and a count
    mesh = sharding.make_mesh("data=2,fsdp=4")
    placed = sharding.shard_state(state, mesh)
    text = sharding.describe(placed)
    device = jax.devices()[0]
    total = per_device = replicated = 0
    for tree in (placed.params, placed.opt_state):
        for leaf in jax.tree.leaves(tree):
            (shard,) = [s for s in leaf.addressable_shards if s.device == device]
            total += leaf.nbytes
            per_device += shard.data.nbytes
            if leaf.sharding.is_fully_replicated:
                replicated += leaf.nbytes
    assert per_device == (total - replicated) / 4 + replicated
    # Every param of this LM divides by 4; the one leftover is Adam's step count, and it is named.
    assert replicated == 4 and "optimizer state not shaped like a param: 0/count" in text
    assert f"{sum(x.nbytes for x in jax.tree.leaves(placed)):,}" in text.splitlines()[0]


def test_sharding_tensor_rules_place_params_and_fsdp_splits_what_they_leave_free():
    state, _, _ = _lm_setup("mixed_bfloat16")
    state = TrainState.create(state.params, optax.adam(1e-3))
    mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
    placed = sharding.shard_state(state, mesh, MEGATRON)
    block = placed.params["DecoderBlock_0"]
    P = jax.sharding.PartitionSpec
    assert block["Dense_0"]["kernel"].sharding.spec == P("fsdp", "tensor")  # (32, 64)
    assert block["Dense_1"]["kernel"].sharding.spec == P("tensor", "fsdp")  # (64, 32)
    attention = block["MultiHeadDotProductAttention_0"]
    assert attention["query"]["kernel"].sharding.spec == P("fsdp", "tensor")  # (32, 4, 8)
    assert attention["out"]["kernel"].sharding.spec == P("tensor", None, "fsdp")  # (4, 8, 32)
    # Adam's moments follow their params; a param no rule names is split over fsdp alone.
    mu = placed.opt_state[0].mu["DecoderBlock_0"]["Dense_0"]["kernel"]
    assert mu.sharding.spec == P("fsdp", "tensor")
    assert placed.params["Embed_0"]["embedding"].sharding.spec == P("fsdp")
    ruled = block["Dense_0"]["kernel"]
    (shard,) = [s for s in ruled.addressable_shards if s.device == jax.devices()[0]]
    assert shard.data.nbytes * 4 == ruled.nbytes
    text = sharding.describe(placed)
    assert "split over fsdp,tensor" in text and "split over fsdp " in text
    # The same rules on a mesh without a tensor axis: that axis is dropped, FSDP places the rest.
    fsdp_only = sharding.shard_state(state, sharding.make_mesh("fsdp=8"), MEGATRON)
    assert fsdp_only.params["DecoderBlock_0"]["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")


@pytest.mark.parametrize(
    "rules,needle",
    [
        ([("*/Dense_0/kernel", (None, "model"))], "unknown mesh axis 'model'; axes: data, fsdp"),
        ([("*/Dense_0/kernel", (None, None, "tensor"))], "has more entries than (32, 64)"),
        ([("*/Dense_0/bias", ("tensor",))], None),
        ([("Embed_0/embedding", (None, ("fsdp", "tensor")))], None),
        ([("pos_embedding", ("tensor", "tensor"))], "axis 'tensor' appears twice"),
        (
            [("*/query/kernel", (None, ("fsdp", "tensor")))],
            "dimension 1 of (32, 4, 8) does not split 8 ways over fsdp,tensor",
        ),
    ],
)
def test_sharding_rules_that_do_not_fit_fail_in_one_line(rules, needle):
    state, _, _ = _lm_setup("float32")
    mesh = sharding.make_mesh("fsdp=2,tensor=4")
    if needle is None:  # these fit
        sharding.shard_state(state, mesh, rules)
        return
    with pytest.raises(ValueError) as info:
        sharding.shard_state(state, mesh, rules)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_sharding_rules_from_flax_partitioning_metadata():
    import flax.linen as nn

    init = nn.initializers.lecun_normal()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, kernel_init=nn.with_partitioning(init, (None, "tensor")))(x)
            return nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(x)

    variables = wrap(Net(), "mixed_bfloat16").init(KEY, jnp.ones((2, 8)))
    rules = sharding.rules_from_metadata(variables, logical_rules=[("mlp", "tensor")])
    assert rules == [("Dense_0/kernel", (None, "tensor")), ("Dense_1/kernel", ("tensor", None))]
    state = TrainState.create(nn.unbox(variables)["params"], optax.sgd(0.1))
    placed = sharding.shard_state(state, sharding.make_mesh("fsdp=4,tensor=2"), rules)
    P = jax.sharding.PartitionSpec
    assert placed.params["Dense_0"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert placed.params["Dense_1"]["kernel"].sharding.spec == P("tensor", "fsdp")


def test_sharding_describe_names_what_stays_replicated_and_why():
    import flax.linen as nn

    params = nn.Dense(3).init(KEY, jnp.ones((1, 8)))["params"]  # kernel (8, 3), bias (3,)
    state = TrainState.create(params, optax.adam(1e-3), loss_scale=DynamicLossScale())
    placed = sharding.shard_state(state, sharding.make_mesh("fsdp=4,data=2"))
    assert placed.params["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp")
    assert placed.params["bias"].sharding.is_fully_replicated
    text = sharding.describe(placed)
    assert "no dimension of (3,) divides by fsdp=4: bias" in text
    assert "optimizer state not shaped like a param: 0/count" in text
    assert "mesh data=2, fsdp=4" in text


def test_sharding_inf_in_one_devices_shard_skips_the_step_everywhere_bit_identically():
    model, batch = wrap(MLP(), "mixed_float16"), make_batch(size=16)
    params = model.init(KEY, batch["x"])["params"]
    tx = optax.adam(1e-2)
    state = TrainState.create(params, tx, loss_scale=DynamicLossScale(2.0**10))
    mesh = sharding.make_mesh("data=2,fsdp=4")
    placed = sharding.shard_state(state, mesh)
    p_step = sharding.make_sharded_train_step(
        make_train_step(make_loss_fn(model), tx), mesh, sharding.state_shardings(placed)
    )
    placed, _ = p_step(placed, sharding.shard_batch(batch, mesh), KEY)
    before = jax.tree.map(np.asarray, placed)
    poisoned = {**batch, "x": batch["x"].at[0, 0].set(jnp.inf)}  # row 0: device 0's shard only
    after, metrics = p_step(placed, sharding.shard_batch(poisoned, mesh), KEY)
    assert not bool(metrics["grads_finite"])
    for name in ("params", "opt_state", "model_state"):
        jax.tree.map(np.testing.assert_array_equal, getattr(after, name), getattr(before, name))
        for leaf in jax.tree.leaves(getattr(after, name)):  # every device's copy alike
            copies = [np.asarray(s.data) for s in leaf.addressable_shards if s.index == ()]
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0])
    assert float(after.loss_scale.loss_scale) == 2.0**9 and int(after.skipped_steps) == 1
    assert p_step._cache_size() == 1


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("data=3,fsdp=4", "needs 12 devices; there are 8 (cpu x8"),
        ("data=2,fsdp=8", "needs 16 devices"),
        ("pipeline=8", "unknown mesh axis 'pipeline'; axes: data, fsdp, tensor"),
        ("fsdp=-1,data=-1", "only one mesh axis may be -1"),
        ("fsdp=0", "sizes are positive integers"),
        ("fsdp", "is not axis=size"),
        ("data=3,fsdp=-1", "8 devices do not divide by 3"),
    ],
)
def test_sharding_make_mesh_errors_are_one_line(spec, needle):
    with pytest.raises(ValueError) as info:
        sharding.make_mesh(spec)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_sharding_make_mesh_orders_axes_and_fills_minus_one():
    mesh = sharding.make_mesh("fsdp=-1,data=2")
    assert mesh.axis_names == ("data", "fsdp") and dict(mesh.shape) == {"data": 2, "fsdp": 4}
    assert sharding.make_mesh({"fsdp": 8}).devices.size == 8


def test_sharding_rejects_a_pmap_step_and_a_batch_that_does_not_split():
    state, _, batch = _lm_setup("float32")
    mesh = sharding.make_mesh("fsdp=8")
    pmap_step = make_train_step(lambda *a: (0.0, ({}, {})), optax.sgd(0.1), axis_name="batch")
    with pytest.raises(ValueError, match="without axis_name"):
        sharding.make_sharded_train_step(pmap_step, mesh, sharding.state_shardings(state, mesh))
    with pytest.raises(ValueError, match="a batch of 12 does not split over 8 devices"):
        sharding.shard_batch({"x": batch["x"][:12]}, mesh)
