"""jamp.grad_stats: the gradients' norm, finiteness and per-module flags from one grouped pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jamp import grad_stats as gs


def _tree():
    # Leaves of one shape (stacked together), others alone, 16-bit and 0-d leaves, and a size
    # shared by different shapes (768 = (768,) = (12, 64)), which are not stacked together.
    key = jax.random.key(0)
    k = jax.random.split(key, 8)
    return {
        "Block_0": {"w": jax.random.normal(k[0], (12, 64)), "b": jax.random.normal(k[1], (768,))},
        "Block_1": {"w": jax.random.normal(k[2], (12, 64)), "b": jax.random.normal(k[3], (768,))},
        "embed": jax.random.normal(k[4], (33, 7)).astype(jnp.bfloat16),
        "scale": jnp.float32(3.0),
        "count": jnp.int32(7),  # not a float: ignored
    }


def test_grad_stats_norm_matches_optax_and_all_finite():
    tree = _tree()
    stats = jax.jit(gs.grad_stats)(tree)
    floats = {k: v for k, v in tree.items() if k != "count"}
    want = optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32), floats))
    np.testing.assert_allclose(stats.norm, want, rtol=1e-6)
    assert bool(stats.finite)
    assert {k: bool(v) for k, v in stats.finite_by_group.items()} == {
        "Block_0": True,
        "Block_1": True,
        "embed": True,
        "scale": True,
    }


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_grad_stats_one_bad_element_flags_its_module_only(bad):
    tree = _tree()
    tree["Block_1"]["b"] = tree["Block_1"]["b"].at[5].set(bad)
    stats = jax.jit(gs.grad_stats)(tree)
    assert not bool(stats.finite)
    flags = {k: bool(v) for k, v in stats.finite_by_group.items()}
    assert flags == {"Block_0": True, "Block_1": False, "embed": True, "scale": True}


def test_grad_stats_bad_bf16_and_scalar_leaves_are_caught():
    tree = _tree()
    tree["embed"] = tree["embed"].at[3, 2].set(jnp.inf)
    tree["scale"] = jnp.float32(jnp.nan)
    stats = gs.grad_stats(tree)
    assert not bool(stats.finite)
    assert not bool(stats.finite_by_group["embed"]) and not bool(stats.finite_by_group["scale"])
    assert bool(stats.finite_by_group["Block_0"])


def test_grad_stats_large_finite_values_are_finite_though_their_squares_overflow():
    # The verdict is about the elements, not the sum of squares: 1e30**2 overflows float32.
    stats = gs.grad_stats({"a": jnp.full((4,), 1e30, jnp.float32), "b": jnp.ones(3)})
    assert bool(stats.finite)
    assert np.isinf(float(stats.norm))


def test_grad_stats_depth_zero_and_empty_trees():
    stats = gs.grad_stats(_tree(), depth=0)
    assert stats.finite_by_group == {} and bool(stats.finite)
    empty = gs.grad_stats({})
    assert bool(empty.finite) and float(empty.norm) == 0.0 and empty.finite_by_group == {}
    with pytest.raises(ValueError, match="depth must be an int >= 0"):
        gs.grad_stats({}, depth=-1)


def test_grad_stats_reduces_leaves_of_one_shape_together():
    # 40 leaves of one shape and 3 of another: two stacked groups of the first (32 + 8) and one
    # of the second, so three reductions in the jaxpr, not 43; nothing reshaped.
    tree = [jnp.ones((8, 4)) for _ in range(40)] + [jnp.ones(5) for _ in range(3)]
    jaxpr = jax.make_jaxpr(gs.grad_stats)(tree)
    reductions = [
        e
        for e in jaxpr.eqns
        if e.primitive.name == "reduce_sum" and e.outvars[0].aval.shape[:1] == (2,)
    ]
    assert len(reductions) == 3  # each gives (sum of squares, sum of x * 0) per stacked leaf
    assert not [e for e in jaxpr.eqns if e.primitive.name == "reshape"]
    stats = gs.grad_stats(tree)
    np.testing.assert_allclose(stats.norm, np.sqrt(40 * 32 + 15), rtol=1e-6)


def test_leaf_sums_are_per_leaf_in_leaf_order():
    leaves = [jnp.arange(6.0), jnp.ones((2, 3)) * 2, jnp.array([1.0, jnp.inf]), jnp.float32(4)]
    squares, zeros = gs.leaf_sums(leaves)
    np.testing.assert_allclose(squares[:2], [55.0, 24.0])
    assert np.isinf(squares[2]) and float(squares[3]) == 16.0
    assert zeros[0] == 0 and zeros[1] == 0 and np.isnan(zeros[2]) and zeros[3] == 0
