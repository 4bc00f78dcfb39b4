"""Tests for jamp.precision: jmp's grammar, presets, passthrough and error messages."""

import jax.numpy as jnp
import jmp
import pytest

from jamp import hardware, precision
from jamp.precision import DTYPE_NAMES, PRESETS, describe, get_policy

F32, F16, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)
HALF = jnp.dtype(jmp.half_dtype())


def _dtypes(policy):
    return tuple(
        jnp.dtype(d) for d in (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    )


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=f16", (F32, F16, F16)),  # jmp: output follows compute when o= is omitted.
        ("c=bf16", (F32, BF16, BF16)),
        ("p=f16", (F16, F16, F16)),  # compute follows params.
        ("o=f16", (F32, F32, F16)),
        ("p=full,c=half,o=full", (F32, HALF, F32)),
        ("compute=bf16,params=f32,output=f32", (F32, BF16, F32)),
        (" p = f32 , c = bf16 ", (F32, BF16, BF16)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("bf16", (BF16, BF16, BF16)),
        ("float16", (F16, F16, F16)),
        ("half", (HALF, HALF, HALF)),
        ("f32", (F32, F32, F32)),
        ("full", (F32, F32, F32)),
        ("float32", (F32, F32, F32)),
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        # a params dtype after a preset replaces the preset's: bfloat16 stored params
        ("mixed_bfloat16,params=bf16", (BF16, BF16, F32)),
        ("mixed_fp8, p=bf16", (BF16, BF16, F32)),
    ],
)
def test_get_policy_accepts_grammar_and_presets(spec, expected):
    policy = get_policy(spec)
    assert isinstance(policy, jmp.Policy)
    assert _dtypes(policy) == expected


@pytest.mark.parametrize("spec", ["p=f32,c=f16", "c=bf16", "bf16", "p=f16,c=f16,o=f32", "half"])
def test_get_policy_matches_jmp_on_jmp_grammar(spec):
    assert _dtypes(get_policy(spec)) == _dtypes(jmp.get_policy(spec))


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_get_policy_every_dtype_name_is_one_jmp_accepts(name):
    assert _dtypes(get_policy(name)) == _dtypes(jmp.get_policy(name))


def test_get_policy_presets_listed():
    assert PRESETS == ("float32", "mixed_float16", "mixed_bfloat16", "mixed_fp8")
    for preset in PRESETS:
        assert _dtypes(get_policy(preset))[0] == F32


def test_get_policy_returns_one_type_and_takes_jmp_policies():
    ours = get_policy("mixed_bfloat16,reduce=bf16")
    assert get_policy(ours) is ours  # a jamp policy is returned as is
    theirs = jmp.Policy(jnp.float32, jnp.float64, jnp.float16)  # not validated
    policy = get_policy(theirs)
    assert type(policy) is precision.Policy and isinstance(policy, jmp.Policy)
    assert _dtypes(policy) == _dtypes(theirs)
    assert (policy.reduce_dtype, policy.matmul) == (jnp.float32, "")
    # Equal to jmp's own policy with the same dtypes, either way round, and hashed alike.
    assert policy == theirs and theirs == policy and hash(policy) == hash(theirs)
    assert get_policy("mixed_bfloat16") == jmp.get_policy("p=f32,c=bf16,o=f32")
    assert ours != jmp.get_policy("p=f32,c=bf16,o=f32")  # it names a reduce dtype jmp's lacks
    for spec in ("float32", "mixed_float16", "mixed_fp8", "auto", "c=bf16", "bf16"):
        assert type(get_policy(spec)) is precision.Policy


@pytest.mark.parametrize(
    "spec, bad_token",
    [
        ("", "''"),
        ("   ", "empty"),
        ("x=f32", "'x'"),
        ("param=f32", "'param'"),
        ("p=f64", "'f64'"),
        ("float64", "'float64'"),
        ("c=int8", "'int8'"),
        ("f", "'f'"),  # jmp's own error message suggests 'f' for 'full', but jmp refuses it.
        ("BF16", "'BF16'"),
        ("mixed_float8", "'mixed_float8'"),
        ("AUTO", "'AUTO'"),
        ("automatic", "'automatic'"),
        ("p=f32=f16", "'f32=f16'"),
        ("p=f32,", "''"),
        ("p=f32,c", "'c'"),
        ("p=f32,p=f16", "'p'"),
        ("p=f32,params=f16", "params given twice"),
        ("c=", "''"),
        (5, "int"),
        (None, "NoneType"),
        (jnp.float32, "type"),
    ],
)
def test_get_policy_rejects_bad_input_with_one_clear_error(spec, bad_token):
    with pytest.raises(ValueError) as info:
        get_policy(spec)
    message = str(info.value)
    assert bad_token in message
    # one short line: the presets, auto, dtype names, a pairs example and where the grammar is
    for accepted in (
        "'auto'",
        "mixed_float16",
        "mixed_bfloat16",
        "bf16",
        "f16",
        "f32",
        "'p=f32,c=bf16,o=f32'",
        "docs/guides/policies.md",
    ):
        assert accepted in message
    assert "\n" not in message and len(message) < 420


def test_describe_gives_full_names():
    assert describe("mixed_bfloat16") == "params=float32,compute=bfloat16,output=float32"
    assert describe(jmp.get_policy("c=f16")) == "params=float32,compute=float16,output=float16"
    assert describe("half") == f"params={HALF.name},compute={HALF.name},output={HALF.name}"


def test_describe_round_trips_through_get_policy():
    for spec in PRESETS + ("c=bf16", "p=f16,c=f16,o=f32"):
        policy = get_policy(spec)
        assert _dtypes(get_policy(describe(policy))) == _dtypes(policy)


@pytest.mark.parametrize(
    "spec,reduce",
    [
        ("mixed_bfloat16,reduce=bf16", jnp.bfloat16),
        ("p=f32,c=f16,o=f32,r=f16", jnp.float16),
        (" mixed_bfloat16 , r = bfloat16", jnp.bfloat16),
        ("mixed_bfloat16,reduce=f32", jnp.float32),
        ("mixed_bfloat16", jnp.float32),
    ],
)
def test_get_policy_reduce_dtype_is_a_fourth_optional_field(spec, reduce):
    policy = get_policy(spec)
    assert isinstance(policy, jmp.Policy)  # whatever takes a jmp policy takes it
    assert precision.reduce_dtype(policy) == jnp.dtype(reduce)
    assert policy.compute_dtype in (jnp.bfloat16, jnp.float16)
    assert policy.cast_to_compute(jnp.ones(2)).dtype == policy.compute_dtype
    # float32 is the default: naming it gives the preset's policy.
    if jnp.dtype(reduce) == jnp.float32:
        assert policy == get_policy("mixed_bfloat16") and str(policy) == "p=full,c=bf16,o=full"
    else:
        assert describe(policy).endswith(f",reduce={jnp.dtype(reduce).name}")
        assert get_policy(str(policy)) == policy and get_policy(describe(policy)) == policy


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("r=bf16", "a reduce or matmul entry alone names no policy"),
        ("mixed_bfloat16,reduce=int8", "Unknown dtype 'int8'"),
        ("mixed_bfloat16,r=bf16,reduce=f32", "duplicate key 'reduce'"),
        ("mixed_bfloat16,c=f16", "duplicate key 'c'"),
        ("mixed_bfloat16,params=bf16,p=f32", "duplicate key 'p'"),
    ],
)
def test_get_policy_reduce_errors_are_one_line(spec, needle):
    with pytest.raises(ValueError) as info:
        get_policy(spec)
    assert needle in str(info.value) and "r/reduce" in str(info.value)
    assert "\n" not in str(info.value)


_ZEN5 = hardware.parse_cpuinfo("model name : AMD EPYC 9B45\nflags : avx2 avx512_bf16\n")
_ZEN3 = hardware.parse_cpuinfo("model name : AMD EPYC 7B13\nflags : avx2 fma\n")


@pytest.fixture(params=[(_ZEN5, "mixed_bfloat16"), (_ZEN3, "float32")], ids=["bf16", "no_bf16"])
def fake_cpu(request, monkeypatch):
    """Makes this machine's CPU look like one with native bf16, or one without; yields the
    preset "auto" must pick there."""
    cpu, preset = request.param
    monkeypatch.setattr(hardware, "read_cpuinfo", lambda: cpu)
    return preset


def test_get_policy_auto_picks_what_the_cpu_runs_natively(fake_cpu):
    assert _dtypes(get_policy("auto")) == _dtypes(get_policy(fake_cpu))
    assert _dtypes(get_policy(" auto ")) == _dtypes(get_policy(fake_cpu))
    assert describe("auto") == describe(fake_cpu)
    why = precision.auto_reason("auto")
    assert why == hardware.auto_policy()[1] and f"auto picked {fake_cpu}" in why


def test_get_policy_auto_takes_a_reduce_dtype_like_a_preset(fake_cpu):
    # The wire dtype of sharded gradients is a bandwidth choice, apart from the compute dtype.
    policy = get_policy("auto,reduce=bf16")
    assert _dtypes(policy) == _dtypes(get_policy(fake_cpu))
    assert precision.reduce_dtype(policy) == BF16
    assert precision.auto_reason("auto,reduce=bf16") == precision.auto_reason("auto")


def test_get_policy_auto_refuses_a_second_compute_dtype(fake_cpu):
    with pytest.raises(ValueError, match="duplicate key 'c'"):
        get_policy("auto,c=f16")


def test_auto_reason_is_none_for_other_specs():
    for spec in ("mixed_bfloat16", "float32,reduce=bf16", "c=bf16", jmp.get_policy("bf16")):
        assert precision.auto_reason(spec) is None
    assert "auto" not in PRESETS  # a choice among presets, not one of them
