"""Record each MoE layer's router ids while a program is traced, for byte floors and agreement checks; or set
them (`set_routes`) to a routing regime, so kernels are timed at routings the random model does not produce.

The recorder wraps `model.moe.route` at trace time only: the jitted program returns the ids it recorded as an
extra output of that very step, so a floor counts the experts this step selected. It observes; it selects no
kernel (kernels are chosen by `model.config.Kernels` on the config a program is traced with).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

import model.moe as moe_module


@contextlib.contextmanager
def _route_wrapped(wrap):
    """`model.moe.route` replaced by `wrap(the route in place)` while the block runs (programs traced in it keep
    the wrapper); restored after."""
    saved = moe_module.route
    moe_module.route = wrap(saved)
    try:
        yield
    finally:
        moe_module.route = saved


def record_routes(recorder: list):
    """Append each MoE layer's global router ids [T, K] to `recorder` where `model.moe.moe` routes (outside the
    expert-parallel shard_map, so sharded programs record global ids too)."""
    def wrap(route):
        def recorded(*args, **kwargs):
            weights_TK, ids_TK = route(*args, **kwargs)
            recorder.append(ids_TK)
            return weights_TK, ids_TK
        return recorded

    return _route_wrapped(wrap)


# How the tokens of one row (a verify's K+1 tokens) choose experts when bench sets the routing:
# independent - every token its own top-k at random; neighbour - each of a token's choices repeats one of the previous
# token's with probability `share`, the rest at random (0.5 makes 4 tokens read ~2.5x the experts of one, the
# sharing published for real MoE models); shared - every token of a row the same experts. "model" leaves the
# router alone.
ROUTINGS = ("model", "independent", "neighbour", "shared")
NEIGHBOUR_SHARE = 0.5


def regime_ids(key, rows: int, tokens: int, experts: int, k: int, regime: str, share: float = NEIGHBOUR_SHARE):
    """[rows * tokens, k] int32 expert ids, distinct within each token, for `regime` (not "model")."""
    noise_RTE = jax.random.uniform(key, (rows, tokens, experts))
    if regime == "independent":
        ids_RTK = jax.lax.top_k(noise_RTE, k)[1]
    elif regime == "shared":
        ids_RTK = jnp.broadcast_to(jax.lax.top_k(noise_RTE[:, :1], k)[1], (rows, tokens, k))
    elif regime == "neighbour":
        keep_RTK = jax.random.bernoulli(jax.random.fold_in(key, 1), share, (rows, tokens, k))
        ids = [jax.lax.top_k(noise_RTE[:, 0], k)[1]]
        for t in range(1, tokens):
            # a kept choice outranks every fresh one (noise < 1), so it stays; the rest fill by noise
            bonus_RE = jnp.zeros((rows, experts)).at[jnp.arange(rows)[:, None], ids[-1]].max(
                2.0 * keep_RTK[:, t].astype(jnp.float32))
            ids.append(jax.lax.top_k(noise_RTE[:, t] + bonus_RE, k)[1])
        ids_RTK = jnp.stack(ids, axis=1)
    else:
        raise ValueError(f"routing must be one of {ROUTINGS[1:]}, got {regime!r}")
    return ids_RTK.reshape(rows * tokens, k).astype(jnp.int32)


def set_routes(regime: str, tokens_per_row: int, seed: int = 0, share: float = NEIGHBOUR_SHARE):
    """Replace the expert ids `model.moe.route` returns with `regime_ids` (each MoE layer its own draw; the
    router's weights of those slots are kept, so the kernels see realistic magnitudes). The model is unchanged:
    bench swaps the router's output at trace time, as `record_routes` observes it. "model": no change."""
    if regime == "model":
        return contextlib.nullcontext()
    layer = [0]

    def wrap(route):
        def routed(x_TH, *args, **kwargs):
            weights_TK, ids_TK = route(x_TH, *args, **kwargs)
            n, k = ids_TK.shape
            experts = args[0].shape[0] if args else kwargs["router_EH"].shape[0]
            key = jax.random.fold_in(jax.random.PRNGKey(seed), layer[0])
            layer[0] += 1
            return weights_TK, regime_ids(key, n // tokens_per_row, tokens_per_row, experts, k, regime, share)
        return routed

    return _route_wrapped(wrap)
