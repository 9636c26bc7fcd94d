"""Logit processing shared by draft, target and baseline: temperature, top-k, top-p -> probabilities.

The parameters are traced values, so changing them never recompiles; only greedy vs sampling is static.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from model.shard_local import held_whole, split_by_rows


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> "SamplingParams":
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        return self

    def as_arrays(self) -> dict:
        return dict(
            temperature=jnp.float32(max(self.temperature, 1e-6)),
            top_k=jnp.int32(self.top_k),
            top_p=jnp.float32(self.top_p),
        )


def processed_probs(logits_XV: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """Softmax of logits / temperature restricted to the top-k, then to the smallest top-p nucleus."""
    scaled = logits_XV.astype(jnp.float32) / temperature
    v = scaled.shape[-1]
    # One descending sort serves both cuts: softmax keeps the order of the logits, so the nucleus is read off the
    # sorted row and applied as a cut on the logits themselves (a sort over the vocabulary dominates this function's
    # cost where the vocabulary is large, and it runs for every position a cycle samples).
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, scaled.shape[:-1])[..., None], axis=-1)
    in_top_k = sorted_desc >= kth  # every logit tied with the k-th is kept too
    sorted_probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    # nucleus: keep tokens whose preceding cumulative mass (in descending order) is < top_p. top_p = 1 keeps every
    # token: the float32 running mass reaches 1.0 before the end of a long tail, which `< 1` alone would cut off.
    # The most likely token is always kept: a top_p > 0 that float32 holds as 0 (or flushes to 0 as a subnormal)
    # would otherwise keep none, and the softmax over no token is NaN.
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    first = jnp.arange(v) == 0
    keep_sorted = in_top_k & ((mass_before < top_p) | (top_p >= 1.0) | first)
    # the last kept logit: a token tied with it is kept too, whatever order the sort gave the tie
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jax.nn.softmax(jnp.where(scaled >= cutoff, scaled, -jnp.inf), axis=-1)


def processed_probs_by_rows(logits_XV: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """`processed_probs` with its rows split over the devices of the ambient mesh (`split_by_rows`; the
    parameters are whole). The target's logits arrive split over the vocabulary, along which the processing sorts
    and sums: left to GSPMD, the processed rows are gathered whole onto every device. By rows, one all-to-all
    brings each device its rows, and draws and acceptance tests on them stay there."""
    return split_by_rows(processed_probs(split_by_rows(logits_XV), temperature, top_k, top_p))


def sample(key, probs_XV: jax.Array) -> jax.Array:
    return jax.random.categorical(key, jnp.log(probs_XV), axis=-1).astype(jnp.int32)


def next_token(key, logits_BV: jax.Array, greedy: bool, sp: dict) -> jax.Array:
    """[B] int32: each row's argmax where greedy, else a draw from its processed probabilities (split by rows on a
    mesh, `processed_probs_by_rows`), held whole on every device as the state keeps tokens."""
    if greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return held_whole(sample(key, processed_probs_by_rows(logits_BV, **sp)))
