"""Expert-parallel routed experts: each device runs only the experts it holds, a psum combines them.

The routed experts [E, ...] are split over every device of the mesh by the partition rules
(`LOGICAL_TO_MESH["experts"]`), so device d holds experts [d*E/D, (d+1)*E/D). Inside a `shard_map` each
device sees all T tokens and all T*K routing choices (both are tiny and replicated), keeps the
(token, choice) pairs whose expert it holds, zeroes the weight of the others, and runs the caller's per-device
routed experts (`model.moe.routed_experts`: plain XLA here, the Pallas kernel on GPU) over its local experts. Every routed (token, choice) pair is computed on exactly one device, so the psum over the
expert axes is the reference sum, only added up in another order.

The mesh is JAX's ambient one (`jax.set_mesh`, which `mesh_context` enters while a program is traced):
without one, or when the experts do not divide over it, the single-device reference runs unchanged.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.shard_local import shard_map_unchecked
from model.sharding import ambient_mesh, expert_axes


# slots (tokens x choices) up to which the filler is found slot by slot (`first_of`): decode and verify; a batch of
# many rows keeps the reduction, whose element-wise form would grow the program with its rows
UNROLLED_SLOTS = 64


def local_choices(ids_TK: jax.Array, weights_TK: jax.Array, first_expert, num_local: int):
    """Routing choices restricted to experts [first_expert, first_expert + num_local), in local ids.

    A choice of another device's expert keeps weight 0 and is pointed at an expert this device reads
    anyway (its first real choice), so a kernel that reads each distinct expert once reads no extra one. moe_wgmma
    takes the global choices instead and skips other devices' itself (`routed_experts_wgmma(first_expert=)`)."""
    with jax.named_scope("local_choices"):  # named in the compiled program (tests/test_per_device.py finds it)
        local_TK = ids_TK - first_expert
        mine_TK = (local_TK >= 0) & (local_TK < num_local)
        mine_P, local_P = mine_TK.reshape(-1), local_TK.reshape(-1)
        filler = first_of(mine_P, local_P) if mine_P.size <= UNROLLED_SLOTS else jnp.where(
            mine_P.any(), local_P[jnp.argmax(mine_P)], 0)
        return jnp.where(mine_TK, local_TK, filler).astype(jnp.int32), jnp.where(mine_TK, weights_TK, 0.0)


def first_of(mine_P: jax.Array, local_P: jax.Array) -> jax.Array:
    """local_P at the first slot where mine_P holds, else 0, as element-wise operations on each slot (a running
    "any before"): XLA fuses them into the kernel that applies the choices, where a reduction (argmax) is a kernel
    of its own on the layer's chain between the router and the experts."""
    filler, seen = jnp.zeros((), local_P.dtype), jnp.zeros((), bool)
    for p in range(mine_P.shape[0]):
        filler = jnp.where(mine_P[p] & ~seen, local_P[p], filler)
        seen = seen | mine_P[p]
    return filler


def routed_experts_parallel(x_TH: jax.Array, experts, ids_TK: jax.Array, weights_TK: jax.Array,
                            per_device_experts: Callable) -> jax.Array:
    """`per_device_experts(x_TH, experts, ids_TK, weights_TK)` over all experts, computed expert-parallel over the
    ambient mesh (each device over the experts it holds); without a mesh, that function on all experts. On a
    device it is called with the global ids and `first_expert=`, the first of the device's experts: it keeps to
    them itself (model.moe.routed_experts: moe_wgmma's own test, or `local_choices`)."""
    mesh = ambient_mesh()
    axes = None if mesh is None else expert_axes(experts.num_experts, mesh)
    if axes is None:
        return per_device_experts(x_TH, experts, ids_TK, weights_TK)

    def per_device(x_TH, local_experts, ids_TK, weights_TK):
        first = jax.lax.axis_index(axes) * local_experts.num_experts  # split over `axes`, the first axis major
        y_TH = per_device_experts(x_TH, local_experts, ids_TK, weights_TK, first_expert=first)
        return jax.lax.psum(y_TH, axes)

    expert_specs = jax.tree_util.tree_map(lambda _: P(axes), experts)
    # the psum makes the result the same on every device, as out_specs P() says
    return shard_map_unchecked(per_device, mesh, in_specs=(P(), expert_specs, P(), P()), out_specs=P())(
        x_TH, experts, ids_TK, weights_TK)
