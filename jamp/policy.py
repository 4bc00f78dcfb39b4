"""The one policy type: jmp's three dtypes, the dtype sharded gradients are reduced in, fp8 matmuls.

`jamp.get_policy` returns a `Policy` for every spec, and turns a user's `jmp.Policy` into one, so
code reads `policy.reduce_dtype` and `policy.matmul` without probing. It is a `jmp.Policy`: every
jmp method works on it, and whatever takes a jmp policy takes it. The spec grammar, the presets
and their errors are `jamp.precision`'s; this module is the type alone, beneath everything that
reads a policy (`jamp.hardware` included).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import jmp
import numpy as np

#: In an autocast program, this "compute dtype" means: fp8 matmuls, bfloat16 everything else.
#: It is the E4M3 format's dtype (`jamp.fp8.E4M3`), which no policy computes in otherwise.
MATMUL_MARKER = np.dtype(jnp.float8_e4m3fn)
_F32 = np.dtype(np.float32)
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclasses.dataclass(frozen=True, eq=False)
class Policy(jmp.Policy):
    """A `jmp.Policy` that also names the dtype gradients of sharded parameters are reduced in
    (float32 unless a spec says `reduce=`) and what matmuls run in ("" for the compute dtype,
    "f8" for fp8).

    It compares equal to a `jmp.Policy` with the same three dtypes when it names no reduce dtype
    and no fp8, as jmp's own policies compare.
    """

    reduce_dtype: jnp.dtype = _F32
    matmul: str = ""  # "" (the compute dtype) or "f8"

    @classmethod
    def of(cls, policy: jmp.Policy) -> Policy:
        """`policy` as this type: itself when it is one, else its three dtypes, not validated."""
        if isinstance(policy, cls):
            return policy
        return cls(policy.param_dtype, policy.compute_dtype, policy.output_dtype)

    @property
    def is_fp8(self) -> bool:
        """Whether its matmuls run in fp8."""
        return self.matmul == "f8"

    @property
    def autocast_dtype(self) -> np.dtype:
        """What `jamp.autocast` runs its matmuls in: the compute dtype, or `MATMUL_MARKER`."""
        return MATMUL_MARKER if self.is_fp8 else np.dtype(self.compute_dtype)

    def _jmp_fields(self) -> tuple:
        return (self.param_dtype, self.compute_dtype, self.output_dtype)

    def _extras(self) -> tuple:
        return (np.dtype(self.reduce_dtype), self.matmul)

    def __eq__(self, other):
        if not isinstance(other, jmp.Policy):
            return NotImplemented
        other = Policy.of(other)
        return self._jmp_fields() == other._jmp_fields() and self._extras() == other._extras()

    def __hash__(self):
        # A policy with jmp's fields only hashes as jmp's does, since it compares equal to one.
        extras = self._extras()
        return hash(self._jmp_fields() + (() if extras == (_F32, "") else extras))

    def __str__(self):
        text = super().__str__()
        if np.dtype(self.reduce_dtype) != _F32:
            text += f",r={_SHORT[np.dtype(self.reduce_dtype).name]}"
        return text + (f",m={self.matmul}" if self.matmul else "")
