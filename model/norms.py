"""RMSNorm, computed in float32 and cast back (as HF DeepseekV3 / Llama do)."""

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class NormScale:
    """An RMSNorm's second factor, 1 / rms(x) per row, kept as x's sum of squares ([..., 1] float32) with the width
    and eps that turn it into the scale (`rows`): a kernel that takes the sum finishes the norm itself, where XLA
    would spend a kernel of its own on the scale between the reduction and a custom call."""

    sum_squares: jax.Array
    width: int
    eps: float

    def rows(self) -> jax.Array:
        """1 / rms(x) [..., 1] float32."""
        return jax.lax.rsqrt(self.sum_squares / self.width + self.eps)


def rms_norm_factors(x: jax.Array, weight: jax.Array, eps: float,
                     sum_squares: jax.Array | None = None) -> tuple[jax.Array, NormScale]:
    """`rms_norm` as two factors: x * weight in x's dtype and 1 / rms(x) (`NormScale`), whose product is the norm.

    A linear map of the norm is the map of the first factor with its output rows scaled by the second
    (`model.quant.linear`'s `row_scale`), so the map does not wait for the reduction: on a GPU the norm's sum and
    its scaling are kernels of their own, one after the other before the map; factored, the sum runs beside the map
    and the scaling joins the kernel that sums the map's split-K parts. Rounding differs from `rms_norm`'s where x
    is bf16 (x * weight is rounded instead of the normed x), by bf16's step."""
    x32 = x.astype(jnp.float32)
    if sum_squares is None:
        sum_squares = jnp.sum(x32 * x32, axis=-1, keepdims=True)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype), NormScale(sum_squares, x.shape[-1], eps)


def scale_rows(x: jax.Array, scale: NormScale | None) -> jax.Array:
    """x times a norm's second factor in x's dtype (None: x): the norm itself where x is its first factor."""
    return x if scale is None else (x.astype(jnp.float32) * scale.rows()).astype(x.dtype)


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
