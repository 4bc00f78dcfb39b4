"""One module, one name: every report, override and log names a module by its params path.

The path of its parameters in `variables["params"]`, "/"-joined, without the model's class name:
here `Block_0/SelfAttention_0/query`, the query projection of a small linen transformer's
attention. Flax's name scopes spell that projection otherwise: the model's class name on top, and
`SelfAttention_0` twice (`nn.SelfAttention` calls `MultiHeadDotProductAttention`'s own wrapped
`__call__`, which opens a second scope of the same name).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jamp
from jamp import adaptive, fp8
from jamp.inspect import forward_nonfinite, precision_report, range_report

# nn.SelfAttention is the layer whose scope repeats (MultiHeadDotProductAttention called on one
# input opens one scope): Flax says it will deprecate it, and models still use it.
pytestmark = pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")

QUERY = "Block_0/SelfAttention_0/query"
ATTENTION = "Block_0/SelfAttention_0"
X = jax.random.normal(jax.random.key(1), (2, 8, 16))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.SelfAttention(num_heads=2, qkv_features=16, deterministic=True)(x)
        return x + nn.Dense(16)(y)


class TinyTransformer(nn.Module):
    gain: float = 1.0  # scales the block's input: in fp16 the attention overflows past 65504

    @nn.compact
    def __call__(self, x):
        x = Block()(nn.Dense(16, name="stem")(x) * self.gain)
        return nn.Dense(4, name="head")(x)


def _params(model=TinyTransformer()):
    return model.init(jax.random.key(0), X)["params"]


def _module_paths(params) -> set[str]:
    out = {""}
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [jax.tree_util.keystr((k,), simple=True) for k in path][:-1]
        out |= {"/".join(keys[: i + 1]) for i in range(len(keys))}
    return out


def _grad(model):
    def loss(p):
        return jnp.mean(model.apply({"params": p}, X).astype(jnp.float32) ** 2)

    return jax.grad(loss)


def test_params_tree_holds_the_projection_at_its_path():
    assert QUERY in _module_paths(_params())


@pytest.mark.parametrize("wrapped", [False, True])
def test_precision_report_names_the_projection_by_its_params_path(wrapped):
    model = TinyTransformer()
    run = jamp.wrap(model, "mixed_bfloat16") if wrapped else model
    params = _params()
    report = precision_report(_grad(run), params)
    for phase in ("forward", "backward"):
        row = report.row(QUERY, phase)
        assert row is not None and row.flops > 0, phase
    paths = {r.path for r in report.rows}
    assert not [p for p in paths if "SelfAttention_0/SelfAttention_0" in p or "Tiny" in p]
    assert ATTENTION in paths
    assert QUERY in report.table()


def test_range_report_names_the_projection_by_its_params_path():
    model = TinyTransformer()
    params = _params()
    ranges = range_report(
        model,
        {"params": params},
        X,
        loss_fn=lambda p: jnp.mean(model.apply({"params": p}, X) ** 2),
    )
    row = next(r for r in ranges.rows if r.path == QUERY)
    assert row.max_activation is not None and row.max_scaled_grad is not None
    assert QUERY in ranges.table()


def test_an_override_by_the_params_path_takes_effect_on_that_module():
    model = jamp.wrap(TinyTransformer(), "mixed_bfloat16", overrides={QUERY: "float32"})
    report = precision_report(_grad(model), _params())
    query, key = report.row(QUERY, "forward"), report.row(f"{ATTENTION}/key", "forward")
    assert query.flops > 0 and query.flops_16bit == 0  # float32, as overridden
    assert key.flops > 0 and key.flops_16bit == key.flops  # its sibling: the policy's bf16


def test_overflow_attribution_names_the_projection_by_its_params_path():
    model = jamp.wrap(TinyTransformer(gain=1e7), "mixed_float16")
    found = forward_nonfinite(model, {"params": _params()}, X)
    assert found.first == QUERY  # the first call reading the overflowing input
    assert QUERY in found.describe()


@pytest.mark.parametrize("wrapped", [True, False])
def test_fp8_site_and_adaptive_attribution_name_the_projection(wrapped):
    """The fp8 state's key for the query projection's matmul is its params path and
    `/dot_general`, wrapped or autocast (here inside a loss's own scope), and adaptive
    precision's decisions name the projection by it."""
    params = _params()
    if wrapped:
        model = jamp.wrap(TinyTransformer(), "mixed_fp8")
        state = fp8.init_state(lambda p: model.apply({"params": p}, X), params)
    else:

        def loss(p, x):
            with jax.named_scope("loss"):  # a scope of the caller's, above the model's root
                return jnp.mean(TinyTransformer().apply({"params": p}, x) ** 2)

        state = fp8.init_state(jamp.autocast(loss, "mixed_fp8", params_argnums=(0,)), params, X)
    site = f"{QUERY}/dot_general"
    assert site in state.sites
    modules = sorted(_module_paths(params))
    assert all(s.rpartition("/")[0] in modules for s in state.sites)  # every site: a params path
    assert adaptive.site_module(site, modules) == QUERY
    assert adaptive.saturated({site: 2 * adaptive.SATURATION_LIMIT}, modules) == (QUERY,)


def test_fp8_sites_named_by_their_former_spelling_map_one_to_one():
    """A state stored under the former site names (the name stack's: the class name on top,
    `SelfAttention_0` twice) is restored under the params paths."""
    model = jamp.wrap(TinyTransformer(), "mixed_fp8")
    params = _params()

    def run(p):
        return model.apply({"params": p}, X)

    former = fp8.former_names(run, params)
    old = "TinyTransformer/Block_0/SelfAttention_0/SelfAttention_0/query/dot_general"
    assert former[old] == f"{QUERY}/dot_general"
    state = fp8.init_state(run, params)
    assert sorted(former.values()) == sorted(state.sites)
    stored = state.replace(sites={o: state.sites[n] for o, n in former.items()})
    assert fp8.renamed(stored, former).sites.keys() == state.sites.keys()


@pytest.mark.gpu_compile
def test_compile_for_names_the_projection_by_its_params_path():
    """An H200 program: the query projection overridden to float32 is the one float32 GEMM, and
    the report (its table, its dict, the fused attention, the step-time kernels) names it and
    its attention by their params paths."""
    model = jamp.wrap(TinyTransformer(), "mixed_bfloat16", overrides={QUERY: "float32"})
    params = jax.eval_shape(_params)
    report = jamp.compile_for(_grad(model), params, target="h200")
    assert {path for path, *_ in report.fp32_gemms()} == {QUERY}
    assert {r["path"] for r in report.to_dict()["fp32_gemms"]} == {QUERY}
    assert f"  {QUERY} (forward," in report.table()
    assert [a.path for a in report.attention] == [ATTENTION]
    assert {path for path, _, _ in report.attention_traced} == {ATTENTION}
    assert report.estimate is not None  # its costliest kernels, by params path (or outside)
    modules = _module_paths(_params())
    assert {k.path for k in report.estimate.top} <= modules | {"(loss)", "(update)", "(unnamed)"}
    everything = report.table() + report.to_json()
    assert "SelfAttention_0/SelfAttention_0" not in everything
    assert "TinyTransformer/" not in everything
    # Unwrapped, in float32: every GEMM is float32; the model's class name is no module's.
    plain = jamp.compile_for(_grad(TinyTransformer()), params, target="h200")
    paths = {path for path, *_ in plain.fp32_gemms()}
    assert QUERY in paths and paths <= modules
    assert "SelfAttention_0/SelfAttention_0" not in plain.table()
    assert "TinyTransformer/" not in plain.table()


class _Proj(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.Dense(16, name="proj")(x))  # named like its parent


class _Pair(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.Dense(16)(x))


class _Lifted(nn.Module):
    """Modules under lifted transforms, a tied head (`Embed.attend`), a module named like its
    parent, setup's list of layers, an einsum layer, a user's scope, a raw weight."""

    def setup(self):
        self.layers = [nn.Dense(16), nn.Dense(16)]
        self.proj = _Proj()
        self.pair = nn.remat(_Pair)()
        self.embed = nn.Embed(10, 16)
        self.mix = nn.Einsum((16, 16), "btd,df->btf")
        self.w = self.param("w", nn.initializers.normal(), (16, 16))

    def __call__(self, x):
        x = self.proj(self.layers[1](self.layers[0](x)))
        x = self.mix(self.pair(x))
        with jax.named_scope("mine"):  # a user's scope: no module
            x = x @ self.w
        return self.embed.attend(x)

    def encode(self, x):  # its head: proj's Dense_0 (bfloat16)
        return self.proj(self.layers[1](self.layers[0](x)))


@pytest.mark.parametrize("method", [None, "encode"])
def test_fp8_sites_are_named_by_params_paths_under_lifted_transforms_and_methods(method):
    model = _Lifted()
    params = model.init(jax.random.key(0), X)["params"]
    # the tied head in fp8 too: a site of a method other than __call__ (Embed_0.attend's scope)
    wrapped = jamp.wrap(model, "mixed_fp8", overrides={"embed": "mixed_fp8"})
    state = fp8.init_state(lambda p: wrapped.apply({"params": p}, X, method=method), params)
    if method == "encode":  # a root method's scope ("_Lifted.encode") is the root's
        want = ["layers_0/dot_general", "layers_1/dot_general", "proj/proj/dot_general"]
        assert sorted(state.sites) == want
        return
    assert sorted(state.sites) == [
        "dot_general",  # the raw weight's, in the root module itself (under the user's scope)
        "embed/dot_general",
        "layers_0/dot_general",
        "layers_1/dot_general",
        "mix/dot_general",
        "pair/Dense_0/dot_general",
        "pair/Dense_1/dot_general",
        "proj/Dense_0/dot_general",
        "proj/proj/dot_general",
    ]
    assert {s.rpartition("/")[0] for s in state.sites} <= _module_paths(params)
