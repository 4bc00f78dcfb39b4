"""jamp.models.LlamaLM and configs/llama.py: causality, grouped-query attention, rotary positions,
the parameter count, bf16 matmuls under jamp.wrap, and the recipe's variants."""

import math
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_wrap import _loss_and_grad_jaxpr, _matmul_operand_dtypes

import jamp
from jamp.models import get_model, llama, model_task
from jamp.models.llama import LlamaLM

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
RECIPE = pathlib.Path(__file__).resolve().parents[1] / "configs" / "llama.py"
SMALL = dict(vocab_size=50, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64)
TOKENS = np.random.default_rng(0).integers(0, 50, (2, 10), dtype=np.int32)


def _init(model, tokens=TOKENS):
    """The model's variables, drawn with NumPy: compiling Flax's initializers (threefry) for every
    shape took longer than all the tests here."""
    rng = np.random.default_rng(1)

    def draw(path, leaf):
        if path[-1].key == "scale":  # RMSNorm: ones, as Flax initializes it
            return jnp.ones(leaf.shape)
        return jnp.asarray(rng.normal(0.0, 0.2, leaf.shape), jnp.float32)

    shapes = jax.eval_shape(model.init, jax.random.key(1), tokens)
    return jax.tree_util.tree_map_with_path(draw, shapes)


def _num_params(vocab_size, num_layers, d_model, num_heads, num_kv_heads, mlp_dim, **_):
    """The formula of jamp/models/llama.py's docstring."""
    d, kv_width = d_model, d_model // num_heads * num_kv_heads
    per_block = 2 * d * d + 2 * d * kv_width + 3 * d * mlp_dim + 2 * d
    return 2 * vocab_size * d + d + num_layers * per_block


def test_llama_logits_shape_and_causality():
    model = LlamaLM(**{**SMALL, "num_layers": 2}, max_len=16)
    variables = _init(model)
    changed = TOKENS.copy()
    changed[:, 6] = (changed[:, 6] + 1) % 50
    logits = jax.jit(model.apply)(variables, np.concatenate([TOKENS, changed]))  # one compile
    assert logits.shape == (4, 10, 50) and logits.dtype == F32
    before, after = logits[:2], logits[2:]
    np.testing.assert_array_equal(after[:, :6], before[:, :6])  # earlier positions: untouched
    assert not np.allclose(after[:, 6:], before[:, 6:])


def test_llama_grouped_query_attention_equals_multi_head_with_repeated_kv_heads():
    gqa = LlamaLM(**SMALL, max_len=16)  # 4 query heads share 2 k / v heads in pairs
    variables = _init(gqa)
    attn = variables["params"]["layers_0"]["attn"]
    assert attn["q"]["kernel"].shape == (32, 4, 8) and attn["k"]["kernel"].shape == (32, 2, 8)

    mha = LlamaLM(**{**SMALL, "num_kv_heads": 4}, max_len=16)

    def repeat(path, kernel):  # each k / v head once per query head of its group
        return jnp.repeat(kernel, 2, axis=1) if path[-2].key in ("k", "v") else kernel

    mha_params = jax.tree_util.tree_map_with_path(repeat, variables["params"])

    @jax.jit
    def both():
        return mha.apply({"params": mha_params}, TOKENS), gqa.apply(variables, TOKENS)

    np.testing.assert_allclose(*both(), atol=1e-5)
    with pytest.raises(ValueError, match="num_kv_heads dividing num_heads"):
        LlamaLM(**{**SMALL, "num_kv_heads": 3}, max_len=16)  # on construction: a one-line error


def test_llama_rope_rotation_depends_only_on_relative_position():
    # One query vector and one key vector, placed at every position [1, 12, 1, 8].
    q, k = (np.broadcast_to(v, (1, 12, 1, 8)) for v in np.random.default_rng(2).normal(size=(2, 8)))
    rq, rk = np.asarray(jax.jit(jax.vmap(llama.rotate, (0, None)))(np.stack([q, k]), 10000.0))
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(rq[:, 0], q[:, 0], rtol=1e-6)  # position 0: no rotation

    def score(i, j):
        return np.dot(rq[0, i, 0], rk[0, j, 0])

    np.testing.assert_allclose(score(3, 1), score(9, 7), rtol=1e-4)
    assert not np.isclose(score(3, 1), score(3, 2), rtol=1e-2)


def test_llama_rope_makes_logits_depend_on_position(monkeypatch):
    # With nothing but RoPE marking positions, the last position of a one-layer causal model sees
    # its prefix as a set: swapping two earlier tokens changes its logits only by the rotation.
    # (From two layers on, the earlier positions' outputs differ with their order anyway.)
    model = LlamaLM(**SMALL, max_len=16)  # one layer (see the control)
    tokens = jnp.array([[3, 7, 11, 5], [7, 3, 11, 5]])  # the same prefix set, in two orders
    variables = _init(model, tokens)

    def last():  # a fresh trace each time: the control below changes the code
        return jax.jit(lambda v: model.apply(v, tokens)[:, -1])(variables)

    first, swapped = last()
    assert not np.allclose(first, swapped, atol=1e-4)
    monkeypatch.setattr(llama, "rotate", lambda x, theta: x)  # the control: no positions at all
    np.testing.assert_allclose(*last(), atol=1e-5)


def test_llama_parameter_count_formula_matches_the_7b_recipe_abstractly():
    config = runpy.run_path(str(RECIPE))["get_config"]("7b")
    model = get_model(config.model, config.vocab_size, **config.model_config.to_dict())
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)  # allocates nothing
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
    assert count == _num_params(config.vocab_size, **config.model_config.to_dict())
    assert count == 6_738_415_616  # Llama-2-7B's published count


def test_llama_wrapped_in_bf16_runs_every_matmul_on_bf16_operands():
    module = LlamaLM(**SMALL, max_len=16)
    variables = _init(module)
    for activations in ("float32", "compute"):  # as jamp runs it on CPUs / on GPUs
        model = jamp.wrap(module, "mixed_bfloat16", activations=activations)
        found = _matmul_operand_dtypes(_loss_and_grad_jaxpr(model, variables, TOKENS, {}))
        # q, k, v, scores, weights @ v, o, gate, up, down; the head; forward and two backward.
        assert len(found) == 3 * (9 + 1)
        assert {dtypes for _, dtypes in found} == {(BF16, BF16)}
    assert jax.eval_shape(model.apply, variables, TOKENS).dtype == F32  # fp32 logits
    # Where jamp is told to keep float32 (here the head, by its path), it does.
    head = jamp.wrap(module, "mixed_bfloat16", {"lm_head": "float32"})
    forward = jax.make_jaxpr(lambda v: head.apply(v, TOKENS))(variables).jaxpr
    assert [d for _, d in _matmul_operand_dtypes(forward)] == [(BF16, BF16)] * 9 + [(F32, F32)]
    control = _matmul_operand_dtypes(_loss_and_grad_jaxpr(module, variables, TOKENS, {}))
    assert {dtypes for _, dtypes in control} == {(F32, F32)}


def test_llama_recipe_variants_load_and_unknown_ones_are_rejected():
    get_config = runpy.run_path(str(RECIPE))["get_config"]
    default, b15, b7, b70, smoke = (get_config(v) for v in ("", "1b5", "7b", "70b", "smoke"))
    assert default.to_dict() == b15.to_dict()
    for c in (b15, b7, b70):
        assert (c.model, c.dataset, c.vocab_size) == ("llama_lm", "synthetic_tokens", 32000)
        assert (c.policy, c.optimizer) == ("mixed_bfloat16", "adamw")
        assert (c.parallelism, c.mesh) == ("sharded", "fsdp=-1")
        assert c.model_config.max_len == c.seq_len
    assert (b15.seq_len, b15.batch_size, b7.seq_len, b7.batch_size) == (2048, 32, 4096, 16)
    assert _num_params(32000, **b15.model_config.to_dict()) == 1_452_394_496  # the docstring's
    assert _num_params(32000, **b70.model_config.to_dict()) == 68_976_648_192  # Llama-2-70B's
    assert b70.model_config.remat == "none"
    assert model_task(b7.model) == "lm"
    assert (smoke.dataset, smoke.parallelism, smoke.model_config.d_model) == ("pydoc", "pmap", 32)
    smoke.seq_len = 32  # an override of seq_len carries the model's max_len with it
    assert smoke.model_config.to_dict()["max_len"] == 32
    with pytest.raises(ValueError, match=r"^unknown config variant 'huge'; accepted: '', '1b5'"):
        get_config("huge")


def test_llama_remat_keeps_the_gradients_and_rejects_unknown_policies():
    """remat="dots" (a block keeps its dense layers' outputs and recomputes the rest, so FSDP's
    weights are gathered again for the backward: experiments/gpu_compile.py's master-weights
    part) and "full" give the gradients of "none", under jamp.wrap too."""
    tokens = TOKENS[:, :8]

    def grads(remat):
        model = jamp.wrap(
            LlamaLM(**{**SMALL, "num_layers": 2}, max_len=16, remat=remat), "mixed_bfloat16"
        )
        variables = _init(model, tokens)
        loss = lambda p: jnp.mean(model.apply({"params": p}, tokens).astype(jnp.float32) ** 2)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(loss))(variables["params"])
        return jax.jit(jax.grad(loss))(variables["params"]), str(jaxpr)

    plain, plain_jaxpr = grads("none")
    assert "remat" not in plain_jaxpr and "checkpoint" not in plain_jaxpr
    for remat in ("dots", "full"):
        got, jaxpr = grads(remat)
        assert "remat" in jaxpr or "checkpoint" in jaxpr
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-2, atol=1e-5)
    with pytest.raises(
        ValueError, match=r"^LlamaLM: unknown remat 'some'; accepted: none, dots, full$"
    ):
        LlamaLM(**SMALL, max_len=16, remat="some")
