"""RMSNorm, computed in float32 and cast back (as HF DeepseekV3 / Llama do)."""

import math

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, sum_squares: jax.Array | None = None) -> jax.Array:
    """`sum_squares` [..., 1] float32, where given, is x's sum of squares over its last axis
    (`sums_of_squares_of_parts`), so the reduction is not computed here."""
    x32 = x.astype(jnp.float32)
    if sum_squares is None:
        sum_squares = jnp.sum(x32 * x32, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(sum_squares / x.shape[-1] + eps)
    return weight * normed.astype(x.dtype)


def sums_of_squares_of_parts(x: jax.Array, widths: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """The sums of squares ([..., 1] float32) of consecutive parts of x's last axis, `widths` wide from its start,
    from one reduction: the parts are cut into runs of gcd(widths) elements, one reduction sums each run, and each
    part's sum adds its runs, a few additions its consumers fuse. On a GPU each reduction is a kernel of its own, and
    MLA's q_a and kv_a norms (1536 = 3 x 512 wide in Kimi-K2.5) read one projection's output."""
    run = math.gcd(*widths)
    x32 = x[..., :sum(widths)].astype(jnp.float32)
    runs = jnp.sum(jnp.square(x32).reshape(*x.shape[:-1], sum(widths) // run, run), axis=-1)
    ends = [0]
    for width in widths:
        ends.append(ends[-1] + width // run)
    return tuple(sum(runs[..., i:i + 1] for i in range(a, b)) for a, b in zip(ends, ends[1:]))
