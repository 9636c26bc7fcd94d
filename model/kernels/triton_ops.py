"""Small building blocks of the Pallas (Triton) kernels, each with its plain-jnp form for interpret mode.

Index arithmetic: lax.div / lax.rem truncate, which equals floor division for the non-negative indices the kernels
use; jnp's floor division emits sign fix-ups that Triton's lowering rejects.

Single PTX instructions: Triton leaves a * b + c as FMUL + FADD, and ptxas needs two LOP3 for (a & imm) | imm (one
immediate per LOP3); in the gemv kernel's profile the two made a third of its instructions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton


def div(a, b: int):
    return jax.lax.div(a, jnp.int32(b))


def rem(a, b: int):
    return jax.lax.rem(a, jnp.int32(b))


def even_splits(n: int, requested: int) -> tuple[int, int]:
    """n items (slots, cache blocks) shared by at most `requested` programs -> (programs, items per program)."""
    splits = max(1, min(requested, n))
    return splits, -(-n // splits)


def _asm(asm: str, constraint: str, dtype, *args):
    shape = jnp.broadcast_shapes(*(a.shape for a in args))
    args = [jnp.broadcast_to(a, shape) for a in args]
    constraints = ",".join([f"={constraint}"] + [constraint] * len(args))
    return pl_triton.elementwise_inline_asm(asm, args=args, constraints=constraints, pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)])[0]


def fma(a: jax.Array, b: jax.Array, c: jax.Array, ptx: bool) -> jax.Array:
    """a * b + c (float32) in one instruction and one rounding on the GPU."""
    if not ptx:
        return a * b + c
    return _asm("fma.rn.f32 $0, $1, $2, $3;", "f", jnp.float32, *(v.astype(jnp.float32) for v in (a, b, c)))


def and_or(a: jax.Array, mask: int, bits: int, ptx: bool) -> jax.Array:
    """(a & mask) | bits on uint32 in one LOP3 (the constants ride in registers; both below 2**31)."""
    if not ptx:
        return (a & jnp.uint32(mask)) | jnp.uint32(bits)
    # Triton's inline asm takes signless integers only: int32 in and out, same bits
    a32 = jax.lax.bitcast_convert_type(a, jnp.int32)
    m = jnp.full(a.shape, mask, jnp.int32)
    b = jnp.full(a.shape, bits, jnp.int32)
    out = _asm("lop3.b32 $0, $1, $2, $3, 0xEA;", "r", jnp.int32, a32, m, b)  # 0xEA: (a & b) | c
    return jax.lax.bitcast_convert_type(out, jnp.uint32)
