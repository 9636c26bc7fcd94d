"""Single PTX instructions for the Triton kernels, each with its plain-jnp equivalent for interpret mode.

Why: Triton leaves a * b + c as FMUL + FADD, and ptxas needs two LOP3 for (a & imm) | imm (one immediate
per LOP3); the H200 profile of the gemv kernel (bench/results/) counted both as a third of its instructions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton


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


def _as_i32(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, jnp.int32) if a.dtype == jnp.uint32 else a


# f16 constants as f16x2 registers: 1032 (= 1024 + the nibble bias 8), 1/16, -72 (= -(1024 / 16 + 8))
_F16X2_1032, _F16X2_SIXTEENTH, _F16X2_MINUS_72 = "0x64086408", "0x2C002C00", "0xD480D480"


def nibbles_f16(words: jax.Array, ptx: bool) -> list[jax.Array]:
    """The eight signed 4-bit values q_j (nibble j holds q + 8) of uint32 words as exact float16 -> 8 x words.shape.

    On the GPU two words at a time: per byte k a PRMT gathers byte k of both words into the two halves of one
    register, one LOP3 per nibble turns it into the f16 pair 1024 + n or 1024 + 16 n, and one f16x2 subtract /
    FMA removes 1024 and the bias: 20 instructions for 16 values."""
    if not ptx:
        return [((words >> jnp.uint32(4 * j)) & jnp.uint32(15)).astype(jnp.int32).astype(jnp.float16) - 8.0
                for j in range(8)]
    # one asm block per nibble (Pallas lowers an asm block with one result only): $0 the f16 pair, $1 / $2 the
    # two words; ptxas merges the two blocks' equal PRMTs and hoists the constants' moves out of the loop
    w = _as_i32(words)
    sds = jax.ShapeDtypeStruct(words.shape, jnp.float16)
    out = []
    for j in range(8):
        k, high = divmod(j, 2)
        mask, finish = (("0x00F000F0", "fma.rn.f16x2 $0, t, c16, c72;") if high
                        else ("0x000F000F", "sub.rn.f16x2 $0, t, c1032;"))
        asm = " ".join([
            "{", ".reg .b32 r, t, m, e, c1032, c16, c72;", f"mov.b32 m, {mask};", "mov.b32 e, 0x64006400;",
            f"mov.b32 c1032, {_F16X2_1032};", f"mov.b32 c16, {_F16X2_SIXTEENTH};", f"mov.b32 c72, {_F16X2_MINUS_72};",
            f"prmt.b32 r, $1, $2, 0x{0x0400 | 0x0101 * k:04X};",  # byte k of both words -> the halves' low bytes
            "lop3.b32 t, r, m, e, 0xEA;",  # 0xEA: (a & b) | c -> the f16 pair 1024 + n (or 1024 + 16 n)
            finish, "}"])
        out.append(pl_triton.elementwise_inline_asm(asm, args=[w], constraints="=r,r,r", pack=2,
                                                    result_shape_dtypes=[sds])[0])
    return out


def fma_f16x2(a: jax.Array, b: jax.Array, c: jax.Array | None, ptx: bool) -> jax.Array:
    """a * b + c in float16 (c None: a * b), two elements per instruction on the GPU."""
    shape = jnp.broadcast_shapes(a.shape, b.shape, *(() if c is None else (c.shape,)))
    args = [jnp.broadcast_to(v, shape).astype(jnp.float16) for v in ((a, b) if c is None else (a, b, c))]
    if not ptx:
        return args[0] * args[1] if c is None else args[0] * args[1] + args[2]
    asm = "mul.rn.f16x2 $0, $1, $2;" if c is None else "fma.rn.f16x2 $0, $1, $2, $3;"
    return pl_triton.elementwise_inline_asm(asm, args=args, constraints=",".join(["=r"] + ["r"] * len(args)), pack=2,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float16)])[0]
