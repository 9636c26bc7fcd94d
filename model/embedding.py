"""The embedding table's rows for tokens, with a vocabulary-sharded table looked up where its rows lie.

Plain reference: `embed_VH[tokens_BT]`. Under a mesh that splits the table's vocabulary (model/sharding.py: the
target's `embed`), that gather is left to GSPMD, and what it makes of it depends on the backend: on the CPU it masks
each device's ids and sums the rows with one all-reduce of [B, T, H]; compiled for GPUs, a lookup of one token is
first simplified to a dynamic slice, which GSPMD partitions by all-gathering the whole table onto every device
(Kimi-K2.5: 2.35 GB every decode step and every cycle, inside the device loop; `python -m bench.labs.sharded_census`
lists a program's collectives). Here each device takes the rows it holds inside shard_map, zeros for ids it does
not, and one psum over the vocabulary's mesh axes gives every device the rows: the all-reduce of [B, T, H] on
every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.shard_local import axis_of, shard_map_unchecked, sharded_mesh


def embedding_rows(embed_VH: jax.Array, tokens_BT: jax.Array, vocab_sharded: bool) -> jax.Array:
    """[B, T, H]: row tokens_BT[b, t] of the table, as `embed_VH[tokens_BT]` (a negative id counts from the end and
    an id past either end takes the nearest row, as JAX's indexing does). `vocab_sharded`: the table is placed
    by the rules that split its vocabulary (the target's), so under a mesh that divides it each device looks up
    its own rows."""
    mesh = sharded_mesh() if vocab_sharded else None
    axes = None if mesh is None else axis_of("vocab", embed_VH.shape[0], mesh)
    if axes is None:  # the table whole, or any object indexed as one (bench.per_device's vocabulary shard)
        return embed_VH[tokens_BT]
    v = embed_VH.shape[0]
    tokens_BT = jnp.clip(jnp.where(tokens_BT < 0, tokens_BT + v, tokens_BT), 0, v - 1)

    def per_device(local_VH, tokens_BT):
        rows = local_VH.shape[0]
        local_BT = tokens_BT - jax.lax.axis_index(axes) * rows  # the vocabulary is split over `axes`, major first
        mine_BT = (local_BT >= 0) & (local_BT < rows)
        found_BTH = local_VH[jnp.clip(local_BT, 0, rows - 1)]
        # one device holds each id, so the sum is that device's row exactly, in the table's dtype
        return jax.lax.psum(jnp.where(mine_BT[..., None], found_BTH, jnp.zeros_like(found_BTH)), axes)

    return shard_map_unchecked(per_device, mesh, in_specs=(P(axes, None), P()), out_specs=P())(embed_VH, tokens_BT)
