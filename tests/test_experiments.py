"""experiments/: the benchmark peers build the same networks as jamp.models (no timing here)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

from jamp.models import get_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import peers_flax  # noqa: E402
import peers_torch  # noqa: E402

CASES = {
    "seed_cnn": (10, jnp.zeros((2, 32, 32, 3)), {}),
    "resnet20": (10, jnp.zeros((2, 32, 32, 3)), {}),
    "transformer_lm": (256, jnp.zeros((2, 16), jnp.int32), dict(num_layers=2, d_model=32)),
}


def _shapes(module, x):
    tree = jax.eval_shape(lambda: module.init(jax.random.key(0), x))
    return jax.tree.map(lambda a: (a.shape, a.dtype), tree)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_written_flax_twin_has_jamp_models_parameters(name):
    classes, x, config = CASES[name]
    ours = get_model(name, classes, **config)
    hand = peers_flax.hand_model(name, jnp.bfloat16, classes, **config)
    assert _shapes(hand, x) == _shapes(ours, x)


def test_hand_written_flax_twin_computes_in_its_dtype():
    classes, x, config = CASES["transformer_lm"]
    hand = peers_flax.hand_model("transformer_lm", jnp.bfloat16, classes, **config)
    jaxpr = jax.make_jaxpr(lambda v: hand.apply(v, x))(hand.init(jax.random.key(0), x))
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def test_torch_peer_reports_whether_it_can_run():
    ok, why = peers_torch.available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not ok:
        with pytest.raises(peers_torch.PeerUnsupported):
            peers_torch.make_step("seed_cnn", "float32", {})
