"""Reading what XLA made of a program: its HLO text, GEMMs, collectives and memory plan.

* `text`: the one HLO-text reader (`parse` -> `Program` of `Instruction`s);
* `gemms`: every GEMM / convolution of a compiled program, the dtypes it multiplies, its FLOPs;
* `collectives`: the collectives of a partitioned program, their bytes and mesh axes;
* `buffers`: XLA's buffer assignment, live bytes by dtype at the temporaries' peak;
* `dump`: compiling with XLA's dump on, to get those texts.
"""

from jamp.hlo.collectives import (
    Collective,
    collectives,
    mesh_axes,
    partitioned_hlo,
    replica_groups,
)
from jamp.hlo.gemms import Gemm, gemms
from jamp.hlo.text import Instruction, Program, parse

__all__ = [
    "Collective",
    "Gemm",
    "Instruction",
    "Program",
    "collectives",
    "gemms",
    "mesh_axes",
    "parse",
    "partitioned_hlo",
    "replica_groups",
]
