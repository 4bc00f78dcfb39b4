"""jamp.hlo: reading HLO text, collectives' device groups, XLA's buffer plan (no compile here)."""

import pytest

from jamp import hlo
from jamp.hlo import buffers
from jamp.hlo.collectives import mesh_axes, replica_groups

_PROGRAM = """HloModule jit_step

%fused_dot (p0: bf16[8,4], p1: bf16[4,16]) -> bf16[8,16] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[4,16]{1,0} parameter(1)
  %dot.3 = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(Wrapped.apply))/M/Dense_0/dot_general"}
  ROOT %convert.4 = bf16[8,16]{1,0} convert(%dot.3)
}

ENTRY %main (w: f32[4,16], x: bf16[8,4]) -> (f32[8,16], s8[16]) {
  %w = f32[4,16]{1,0} parameter(0), metadata={op_name="w"}
  %x = bf16[8,4]{1,0} parameter(1)
  %ag = (bf16[1,16]{1,0}, bf16[4,16]{1,0}) all-gather-start(%w), replica_groups=[2,4]<=[8], dimensions={0}
  %agd = bf16[4,16]{1,0} all-gather-done(%ag)
  %gemm = bf16[8,16]{1,0} fusion(%x, %agd), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %cc = (f32[8,16]{1,0}, s8[16]{0}) custom-call(%x, %agd), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/jvp(Wrapped.apply)/M/Dense_0/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %rs = f32[2,16]{1,0} reduce-scatter(%cc#0), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  ROOT %t = (f32[8,16]{1,0}, s8[16]{0}) tuple(%cc#0, %cc#1)
}
"""


def test_hlo_parse_reads_types_operands_tuple_elements_and_computations():
    program = hlo.parse(_PROGRAM)
    assert program.entry == "main"
    ag = program.by_name["ag"]
    assert ag.op == "all-gather-start" and ag.arrays == (("bf16", (1, 16)), ("bf16", (4, 16)))
    rs = program.by_name["rs"]
    assert rs.operands == ("cc",) and rs.operand_elements == (0,)
    gemm = program.by_name["gemm"]
    assert gemm.fusion_kind == "__triton_gemm" and gemm.called == ("fused_dot",)
    assert [i.op for i in program.body(gemm)] == ["parameter", "parameter", "dot", "convert"]
    assert program.by_name["cc"].target == "__cublas$lt$matmul"
    assert program.by_name["w"].op_name == "w"


def test_hlo_gemms_kinds_operand_dtypes_flops_and_accumulation():
    gemms = hlo.gemms(hlo.parse(_PROGRAM))
    assert [(g.kind, g.operands, g.result, g.accumulates, g.flops) for g in gemms] == [
        ("Triton", ("bf16", "bf16"), "bf16", "f32", 2 * 8 * 16 * 4),
        ("cuBLASLt", ("bf16", "bf16"), "f32", "f32", 2 * 8 * 16 * 4),
    ]
    assert not any(g.is_fp32 or g.batched for g in gemms)


def test_hlo_collectives_results_groups_and_what_they_feed():
    gather, scatter = hlo.collectives(hlo.parse(_PROGRAM))
    assert (gather.kind, gather.dtype, gather.shape, gather.nbytes) == (
        "all-gather",
        "bf16",
        (4, 16),
        128,
    )
    assert gather.into_matmul and not gather.from_matmul
    assert gather.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert scatter.from_matmul and not scatter.into_matmul
    assert mesh_axes(gather.groups, [("data", 2), ("fsdp", 4)]) == ("fsdp",)
    # Where XLA kept no name (JAX 0.10's drops it), a collective is named by what it carries.
    assert gather.op_name == "w"
    assert scatter.op_name == "jit(step)/jvp(Wrapped.apply)/M/Dense_0/dot_general"


_COMBINED = """HloModule jit_step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped (p0: f32[2], p1: f32[1]) -> f32[3] {
  %p0 = f32[2]{0} parameter(0)
  %p1 = f32[1]{0} parameter(1)
  ROOT %c = f32[3]{0} concatenate(%p0, %p1), dimensions={0}
}

ENTRY %main (g: f32[2,8], l: f32[8]) -> f32[3] {
  %g = f32[2,8]{1,0} parameter(0)
  %l = f32[8]{0} parameter(1)
  %zero = f32[] constant(0)
  %norms = f32[2]{0} reduce(%g, %zero), dimensions={1}, to_apply=%add, metadata={op_name="jit(step)/grad_stats/reduce_sum"}
  %loss = f32[] reduce(%l, %zero), dimensions={0}, to_apply=%add, metadata={op_name="jit(step)/jvp(loss)/reduce_sum"}
  %loss1 = f32[1]{0} bitcast(%loss)
  %both = f32[3]{0} fusion(%norms, %loss1), kind=kLoop, calls=%wrapped
  %ar = f32[3]{0} all-reduce-start(%both), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=(0,4,1,5,2,6,3,7) {'axis_0'}, to_apply=%add
  ROOT %ard = f32[3]{0} all-reduce-done(%ar)
}
"""


def test_hlo_combined_collective_without_a_name_is_named_by_its_parts():
    """JAX 0.10's XLA combines the step's partial sums into one all-reduce and keeps no name on
    it, nor on the concatenation that feeds it: it takes its parts' names, joined by ":"."""
    (summed,) = hlo.collectives(hlo.parse(_COMBINED))
    assert summed.kind == "all-reduce" and summed.shape == (3,)
    assert summed.op_name == "jit(step)/grad_stats/reduce_sum:jit(step)/jvp(loss)/reduce_sum"
    assert summed.groups == ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize(
    "text,groups",
    [
        ("replica_groups={{0,2},{1,3}}", ((0, 2), (1, 3))),
        ("replica_groups=[2,2]<=[4]", ((0, 1), (2, 3))),
        ("replica_groups=[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
        ("replica_groups=mesh['data'=2,'fsdp'=2] {'data'}", ((0, 2), (1, 3))),
        # JAX 0.10's XLA: its own axis names over listed devices (a data=2 x fsdp=4 mesh's fsdp)
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=(0,4,1,5,2,6,3,7) {'axis_0'}",
            ((0, 1, 2, 3), (4, 5, 6, 7)),
        ),
        # JAX 0.10.2's XLA: the same devices as an iota ([2,4] transposed), a size-1 axis between
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
            "{'axis_0'}",
            ((0, 1, 2, 3), (4, 5, 6, 7)),
        ),
        (
            "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
            "{'axis_2'}",
            ((0, 4), (1, 5), (2, 6), (3, 7)),
        ),
        ("dimensions={0}", None),
    ],
)
def test_hlo_replica_groups_in_every_spelling(text, groups):
    assert replica_groups(text) == groups


def test_hlo_mesh_axes_names_the_axes_a_group_spans():
    axes = [("data", 2), ("fsdp", 2), ("tensor", 2)]
    assert mesh_axes(((0, 4), (1, 5), (2, 6), (3, 7)), axes) == ("data",)
    assert mesh_axes(((0, 1), (2, 3), (4, 5), (6, 7)), axes) == ("tensor",)
    assert mesh_axes(((0, 2, 4, 6), (1, 3, 5, 7)), axes) == ("data", "fsdp")
    assert mesh_axes(((0, 1, 2, 3, 4, 5, 6, 7),), axes) == ("data", "fsdp", "tensor")
    assert mesh_axes(((0, 3), (1, 2)), axes[:2]) == ()


_BUFFERS = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[4,4]| at ShapeIndex {}:
 value: <1 w @0> (size=64,offset=0): f32[4,4]{1,0}
allocation 1: size 100, preallocated-temp:
 value: <2 a @0> (size=32,offset=0): bf16[4,4]{1,0}
 value: <3 b @0> (size=64,offset=32): f32[4,4]{1,0}
 value: <4 c{} @0> (size=16,offset=96): (f32[4,4]{1,0}, s8[8]{0})
 value: <5 c{1} @0> (size=8,offset=0): s8[8]{0}
 value: <6 d @0> (size=32,offset=0): bf16[4,4]{1,0}
"""
_RANGES = """HloLiveRange (max 9):
  BufferLiveRange:
    w{}:0-9
    a{}:1-3
    b{}:2-5
    c{}:4-4
    c{1}:4-4
    d{}:6-7
  Live ranges at 4 (peak):
"""


def test_hlo_buffers_split_the_temporaries_at_their_peak_by_dtype():
    allocations = buffers.parse_buffer_assignment(_BUFFERS)
    assert [(a.kind, a.size, len(a.values)) for a in allocations] == [
        ("parameter", 64, 1),
        ("temp", 100, 5),
    ]
    ranges = buffers.parse_live_ranges(_RANGES)
    assert ranges["a{}"] == (1, 3) and ranges["c{1}"] == (4, 4)
    peak = buffers.temp_peak(allocations, ranges)
    # Steps 2-3 hold a (bf16, 32) and b (f32, 64): 96 of the 100 bytes; c and its workspace
    # (step 4) hold 64 + 16 + 8 = 88.
    assert peak.step == 2 and peak.size == 100
    assert {k: v for k, v in peak.by_class.items() if v} == {"bf16": 32, "f32": 64, "free": 4}
    assert sum(peak.by_class.values()) == 100
    assert buffers.dtype_class("f8e4m3fn") == "fp8" and buffers.dtype_class("s32") == "int"


def test_hlo_buffers_merge_a_buffer_whatever_order_its_values_come_in():
    """Three values at one place whose live ranges chain (the second links the other two) are
    one buffer, counted once; a loop-carried (phi) value is read too."""
    text = """allocation 0: size 100, preallocated-temp:
 value: <1 a @0> (size=40,offset=0): bf16[20]{0}
 value: <2 b @0> (size=40,offset=0): bf16[20]{0}
 value: <3 while.1{0} (phi) @0> (size=40,offset=0): bf16[20]{0}
"""
    allocations = buffers.parse_buffer_assignment(text)
    assert [v.name for v in allocations[0].values] == ["a{}", "b{}", "while.1{0}"]
    ranges = {"a{}": (0, 5), "b{}": (10, 15), "while.1{0}": (5, 10)}
    peak = buffers.temp_peak(allocations, ranges)
    assert peak.by_class["bf16"] == 40 and sum(peak.by_class.values()) == 100


_LOOP = """HloModule loop

%body (p: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %p = (s32[], f32[4,4]{1,0}) parameter(0)
  %x = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %d = f32[4,4]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[4,4]{1,0} all-reduce(%d), replica_groups={}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,4]{1,0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4,4])) -> pred[] {
  %p = (s32[], f32[4,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[4,4]) -> f32[4,4] {
  %x = f32[4,4]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[4,4]{1,0}) tuple(%z, %x)
  %w = (s32[], f32[4,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = f32[4,4]{1,0} get-tuple-element(%w), index=1
}
"""


def test_hlo_counts_inside_a_loop_run_its_trip_count_times():
    """A `lax.scan` (gradient accumulation, layers under scan) is a while loop: its GEMMs and
    collectives run once per trip."""
    program = hlo.parse(_LOOP)
    assert program.multiplicity()["body"] == 4 and program.multiplicity()["main"] == 1
    (gemm,) = hlo.gemms(program)
    assert (gemm.kind, gemm.count, gemm.flops) == ("dot", 4, 2 * 4 * 4 * 4)
    (reduce,) = hlo.collectives(program)
    assert reduce.count == 4 and reduce.groups == () and reduce.from_matmul
    assert mesh_axes(reduce.groups, [("data", 2), ("fsdp", 4)]) == ("data", "fsdp")
    assert mesh_axes(None, [("data", 2), ("fsdp", 4)]) == ()  # a collective-permute's pairs
