"""jamp.adaptive: the blame of one step, the controller's promotions and its state, static
placement; jamp.wrap.module_policies, which tells the controller where each module starts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp import adaptive
from jamp.models import get_model
from jamp.wrap import module_policies

F16, BF16, F32 = np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32)
MODULES = ("Conv_0", "Dense_0", "LayerNorm_0", "Dense_1")


def test_ladder_climbs_to_float32_via_bfloat16_only_where_it_is_fast():
    assert adaptive.ladder(np.float16, bf16_fast=True) == (F16, BF16, F32)
    assert adaptive.ladder(np.float16, bf16_fast=False) == (F16, F32)
    assert adaptive.ladder(jnp.bfloat16) == (BF16, F32)
    assert adaptive.ladder(jnp.float8_e4m3fn)[1:] == (BF16, F32)
    assert adaptive.ladder(np.float32) == (F32,)


def test_blame_names_where_a_forward_overflow_began_in_call_order():
    grads = {m: 0.0 for m in ("Conv_0", "Dense_0", "Dense_1")}  # all nan: no help
    forward = {"Dense_1": 0.0, "LayerNorm_0": 0.0, "Dense_0": 0.0, "Conv_0": 1.0, "": 0.0}
    order = ["Conv_0", "Dense_0", "LayerNorm_0", "Dense_1", ""]
    assert adaptive.blame(grads, forward, order) == ("Dense_0",)
    # averaged over replicas: 0.5 means one replica overflowed there
    assert adaptive.blame(grads, {**forward, "Conv_0": 0.5}, order) == ("Conv_0",)


def test_blame_backward_overflow_names_the_groups_unless_all_overflowed():
    forward = {m: 1.0 for m in MODULES}
    grads = {"Conv_0": 0.0, "Dense_0": 1.0, "Dense_1": 1.0}
    assert adaptive.blame(grads, forward) == ("Conv_0",)
    assert adaptive.blame(grads) == ("Conv_0",)
    order = ["Conv_0", "Dense_0", "LayerNorm_0", "Dense_1", ""]
    # a weight gradient alone: that module
    assert adaptive.blame({"Conv_0": 1.0, "Dense_0": 0.0, "Dense_1": 1.0}, forward, order) == (
        "Dense_0",
    )
    # every group: the loss scale was too large, its own business
    assert adaptive.blame({"Conv_0": 0.0, "Dense_0": 0.0}, forward) == ()
    assert adaptive.blame({"Conv_0": np.array([1, 1]), "Dense_0": np.array([1, 1])}) == ()


def test_blame_backward_overflow_that_flows_back_names_its_boundary():
    # Three float16 Dense layers whose last one's input gradient (dy @ W.T) overflows: its own
    # weight gradient is finite, every module before it is not. The gradient flags alone would
    # blame the innocent Dense_0 and Dense_1; in call order the boundary is Dense_1 | Dense_2.
    import flax.linen as nn

    class Three(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8)(x)
            x = nn.Dense(8)(x)
            big = nn.initializers.constant(3e4)
            return nn.Dense(4, kernel_init=big)(x)

    model = jamp.wrap(Three(), "mixed_float16")
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    order = list(module_policies(model, variables, x))
    grads = jax.grad(lambda p: model.apply({"params": p}, x).sum() * 1e3)(variables["params"])
    flags = jamp.finite_by_group(grads)
    assert [bool(flags[k]) for k in ("Dense_0", "Dense_1", "Dense_2")] == [False, False, True]
    assert adaptive.blame(flags, None, order) == ("Dense_1", "Dense_2")
    assert adaptive.blame(flags) == ("Dense_0", "Dense_1")  # no call order: the groups


def _controller(**kw):
    kw.setdefault("bf16_fast", True)
    return adaptive.Controller("mixed_float16", MODULES, start={"LayerNorm_0": F32}, **kw)


def _run(ctl, state, steps, blamed, *, at_floor=False, decide_every=1):
    changes = []
    for step in steps:
        state = ctl.observe(state, step, skipped=bool(blamed), at_floor=at_floor, blamed=blamed)
        if step % decide_every == 0:
            state, new = ctl.decide(state, step)
            changes += new
    return state, changes


def test_controller_promotes_after_k_of_n_and_only_the_blamed_module():
    ctl = _controller(k=3, n=10)
    state, changes = _run(ctl, ctl.init(), [1, 2], ("Dense_0",))
    assert changes == [] and ctl.overrides(state) == {}
    state, changes = _run(ctl, state, [3], ("Dense_0",))
    assert [(c.step, c.module, c.from_dtype, c.to_dtype) for c in changes] == [
        (3, "Dense_0", "float16", "bfloat16")
    ]
    assert "3 of the last 10" in changes[0].reason
    ((path, policy),) = ctl.overrides(state).items()
    assert path == "Dense_0" and np.dtype(policy.compute_dtype) == BF16
    assert np.dtype(policy.param_dtype) == F32 and np.dtype(policy.output_dtype) == F32
    # the count starts again at the new dtype: three more blames to reach float32
    state, changes = _run(ctl, state, [4, 5], ("Dense_0",))
    assert changes == []
    state, changes = _run(ctl, state, [6], ("Dense_0",))
    assert [c.to_dtype for c in changes] == ["float32"]
    assert ctl.exhausted(state, ("Dense_0",)) == ["Dense_0"]
    assert [ctl.dtype_of(state, m) for m in MODULES] == [F16, F32, F32, F16]


def test_controller_forgets_blames_older_than_n_steps():
    ctl = _controller(k=3, n=10)
    state, _ = _run(ctl, ctl.init(), [1, 2], ("Conv_0",))
    state, _ = _run(ctl, state, range(3, 12), ())  # clean steps overwrite the window
    state, changes = _run(ctl, state, [12], ("Conv_0",))
    assert changes == []


def test_controller_promotes_at_once_at_the_loss_scale_floor():
    ctl = _controller(k=5, n=10)
    state, changes = _run(ctl, ctl.init(), [7], ("Conv_0",), at_floor=True)
    assert [(c.module, c.to_dtype) for c in changes] == [("Conv_0", "bfloat16")]
    assert "floor" in changes[0].reason
    assert ctl.promotions(state) == [
        "Conv_0: float16 -> bfloat16 at step 7 (overflowed with the loss scale at its floor)"
    ]


def test_controller_float32_modules_are_exhausted_not_promoted():
    ctl = _controller(k=1, n=4)
    state, changes = _run(ctl, ctl.init(), [1, 2], ("LayerNorm_0",), at_floor=True)
    assert changes == [] and ctl.exhausted(state, ("LayerNorm_0",)) == ["LayerNorm_0"]


def test_controller_resumed_from_its_checkpointed_state_decides_as_if_never_stopped():
    # The program decides every k steps; a run restored from the state saved at step 6 must
    # promote at step 9 exactly as the uninterrupted one, from the blames before the stop.
    ctl = _controller(k=5, n=10)

    def steps(state, first, last):
        changes = []
        for step in range(first, last + 1):
            blamed = ("Dense_1",) if step % 3 else ()
            state = ctl.observe(state, step, skipped=bool(blamed), at_floor=False, blamed=blamed)
            if step % 3 == 0:
                state, new = ctl.decide(state, step)
                changes += new
        return state, changes

    whole, changes = steps(ctl.init(), 1, 12)
    saved, before = steps(ctl.init(), 1, 6)
    leaves, treedef = jax.tree.flatten(saved)
    restored = jax.tree.unflatten(treedef, [np.array(x) for x in jax.device_get(leaves)])
    ctl.check(restored)
    resumed, after = steps(restored, 7, 12)
    assert before == [] and [c.step for c in changes] == [9] and after == changes
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b, strict=True)


def test_controller_demotes_after_m_clean_steps_only_when_asked():
    ctl = _controller(k=1, n=4, demote_after=5)
    state, _ = _run(ctl, ctl.init(), [1], ("Dense_1",))
    state, changes = _run(ctl, state, range(2, 6), ())
    assert changes == []
    state, changes = _run(ctl, state, [6], ())
    assert [(c.module, c.from_dtype, c.to_dtype) for c in changes] == [
        ("Dense_1", "bfloat16", "float16")
    ]
    never = _controller(k=1, n=4)
    state, _ = _run(never, never.init(), [1], ("Dense_1",))
    state, changes = _run(never, state, range(2, 200), ())
    assert changes == [] and never.overrides(state)


def test_controller_state_survives_tree_round_trips_and_jit():
    ctl = _controller(k=2, n=5)
    state, _ = _run(ctl, ctl.init(), [1, 2], ("Conv_0",))
    leaves, treedef = jax.tree.flatten(state)
    again = jax.tree.unflatten(treedef, leaves)
    through = jax.device_get(jax.jit(lambda s: s)(state))
    for got in (again, through):
        ctl.check(got)
        assert got.modules == MODULES
        for a, b in zip(jax.tree.leaves(got), leaves):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
    with pytest.raises(ValueError, match="another model"):
        _controller(k=2, n=6).check(state)
    # the same number of modules in another order: the fingerprint tells
    other = adaptive.Controller("mixed_float16", MODULES[::-1], k=2, n=5)
    with pytest.raises(ValueError, match="another model"):
        other.check(state.replace(modules=other.modules))


def test_controller_rejects_bad_windows():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        _controller(k=0, n=5)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        _controller(k=6, n=5)
    with pytest.raises(ValueError, match="demote_after"):
        _controller(demote_after=0)


def test_placement_first_and_last_blocks_and_patterns():
    lm = ["Embed_0", *(f"DecoderBlock_{i}" for i in range(4)), "LayerNorm_0", "Dense_0"]
    assert adaptive.blocks(lm) == [f"DecoderBlock_{i}" for i in range(4)]
    got = adaptive.placement_overrides(["first:1", "last:2", "Dense_0"], lm)
    assert got == {
        "DecoderBlock_0": "float32",
        "DecoderBlock_2": "float32",
        "DecoderBlock_3": "float32",
        "Dense_0": "float32",
    }
    cnn = ["Conv_0", "Conv_1", "Dense_0", "Dense_1"]  # no family larger than the others
    assert adaptive.placement_overrides(["first:1", "last:1"], cnn) == {
        "Conv_0": "float32",
        "Dense_1": "float32",
    }
    with pytest.raises(ValueError, match="from 1 to 4"):
        adaptive.placement_overrides(["last:5"], cnn)
    with pytest.raises(ValueError, match="first:N / last:N"):
        adaptive.placement_overrides(["middle:1"], cnn)
    # With the model's module paths, a pattern matching none of them is an error, not a no-op.
    paths = ["", "Embed_0", "DecoderBlock_0", "DecoderBlock_0/Attention_0", "Dense_0"]
    assert adaptive.placement_overrides(["*/Attention_0"], lm, paths) == {
        "*/Attention_0": "float32"
    }
    with pytest.raises(ValueError, match="'Dense_9' matches no module.*Embed_0, DecoderBlock_0"):
        adaptive.placement_overrides(["Dense_0", "Dense_9"], lm, paths)


def test_module_policies_follow_overrides_and_nesting_in_call_order():
    model = jamp.wrap(
        get_model("seed_cnn", 10, hidden_gain=10.0), "mixed_float16", {"Dense_1": "float32"}
    )
    x = jnp.zeros((2, 8, 8, 1))
    variables = model.init(jax.random.key(0), x)
    got = {
        p: np.dtype(pol.compute_dtype) for p, pol in module_policies(model, variables, x).items()
    }
    assert list(got) == ["Conv_0", "Conv_1", "Dense_0", "LayerNorm_0", "Dense_1", ""]
    assert got == {
        "Conv_0": F16,
        "Conv_1": F16,
        "Dense_0": F16,
        "LayerNorm_0": F32,
        "Dense_1": F32,
        "": F16,
    }
