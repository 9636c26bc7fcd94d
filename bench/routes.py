"""The routing regimes bench times kernels under: expert ids handed to the model's forward
(`model.decoder.forward(expert_ids=...)`) in place of its router's choices, so kernels are timed at routings a
random model does not produce. The ids a step ran come back as its `ForwardOutput.expert_ids`, so a floor counts the
experts that very step selected. Neither selects a kernel (kernels are chosen by `model.config.Kernels` on the
config a program is traced with).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def regime_routes(regime: str, rows: int, tokens_per_row: int, moe_layers: int, experts: int, k: int, seed: int = 0,
                  share: float = NEIGHBOUR_SHARE) -> tuple[jax.Array, ...] | None:
    """`forward`'s `expert_ids` for `regime`: each MoE layer its own `regime_ids` draw [rows * tokens_per_row, k]
    (the router's weights of those slots are kept, so the kernels see realistic magnitudes); None for "model" (the
    router chooses)."""
    if regime == "model":
        return None
    return tuple(regime_ids(jax.random.fold_in(jax.random.PRNGKey(seed), layer), rows, tokens_per_row, experts, k,
                            regime, share) for layer in range(moe_layers))
