"""Work GSPMD cannot split, run per device: a Pallas kernel over each device's own block, inside shard_map, and
row-wise work along a split axis over each device's own rows (`per_device_rows`, with `held_to_rules` keeping the
layouts on either side where they were).

A Pallas kernel is one custom call that GSPMD cannot split: left to it, every operand would be gathered whole onto
each device (for MLA attention, the cache and every head's query) and the kernel run on all of it everywhere. Inside
`shard_map` each device calls the kernel at its local shapes, as one device of the mesh would run it alone: the MLA
decode kernels over the heads and batch rows it holds (model.attention_mla), the router's kernels over the
replicated tokens (model.router), the routed experts over its own experts (model.moe_parallel).

The mesh is JAX's ambient one (`jax.set_mesh`, which `model.sharding.mesh_context` enters while a program is
traced); without one, or on a mesh of one device, the kernel is called as it is.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from model.sharding import ambient_mesh, spec_for, specs_for

try:  # jax >= 0.7 exports shard_map at the top level
    from jax import shard_map as _shard_map

    _UNCHECKED = {"check_vma": False}
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _UNCHECKED = {"check_rep": False}


def sharded_mesh():
    """The ambient mesh where it has more than one device, else None."""
    mesh = ambient_mesh()
    return None if mesh is None or mesh.size == 1 else mesh


def shard_map_unchecked(fn: Callable, mesh, in_specs, out_specs) -> Callable:
    """`fn` per device over `mesh`. Unchecked: a Pallas kernel's outputs carry no varying-axes annotation, which the
    check would reject; each caller's out_specs say how its outputs are laid out."""
    return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_UNCHECKED)


def axis_of(logical: str, size: int, mesh):
    """The mesh axes a dimension of `size` along `logical` is split over under model.sharding's rules (None where
    they do not divide it), so a kernel's block is the one the weights and caches are placed in."""
    return spec_for((logical,), (size,), mesh)[0]


def per_device_replicated(fn: Callable, *args):
    """`fn(*args)` with every operand and output whole on every device: each device runs it on its copy (a kernel
    over small replicated inputs, such as the router's, which GSPMD would otherwise have to place itself)."""
    mesh = sharded_mesh()
    if mesh is None:
        return fn(*args)
    return shard_map_unchecked(fn, mesh, in_specs=tuple(P() for _ in args), out_specs=P())(*args)


def held_to_rules(x: jax.Array, logical: tuple) -> jax.Array:
    """`x` held to the layout model.sharding's rules give a value of these logical axes (`()`: whole on every
    device) under the ambient mesh; as it is without one. GSPMD lays out what nothing holds by what its producers
    and consumers ask, backwards too: a value held where one computation hands it to another keeps a consumer's
    layout (sampling's rows split over the devices) from spreading into the producer (the forward)."""
    mesh = sharded_mesh()
    return x if mesh is None else jax.lax.with_sharding_constraint(x, spec_for(logical, x.shape, mesh))


def held_to_table(tree, rules):
    """Every array of `tree` held to the layout a table of model.sharding (`rules`, by the array's path in the
    tree) gives it, under the ambient mesh; as it is without one. The state a step returns is held so to the layout
    the engine keeps between steps (STATE_RULES): inside a device loop nothing else holds the loop's carry, and a
    layout by rows inside the step (`split_by_rows`) would spread into it and on into the next step's forward."""
    mesh = sharded_mesh()
    return tree if mesh is None else jax.lax.with_sharding_constraint(tree, specs_for(tree, mesh, rules))


def held_whole(tree):
    """Every array of `tree` held whole on every device (`held_to_rules(x, ())`)."""
    return jax.tree_util.tree_map(lambda x: held_to_rules(x, ()), tree)


def per_device_rows(fn: Callable, *args):
    """`fn(*args)` with the leading (row) axis of every operand and output split over all the mesh's devices and
    the rest of each row whole on its device: each device runs `fn` over its share of the rows, so `fn` must treat
    rows independently. Where the devices do not divide the rows, or without a mesh, `fn` runs as it is.

    For work along a split axis that GSPMD cannot split (sampling's sort and running sums along the vocabulary,
    which it would otherwise run on rows gathered whole onto every device): the operands are laid out by rows
    on the way in, one all-to-all for an operand split along another axis."""
    mesh, rows = _rows_split(args[0].shape[0])
    if rows is None:
        return fn(*args)
    return shard_map_unchecked(fn, mesh, in_specs=tuple(rows for _ in args), out_specs=rows)(*args)


def split_by_rows(x: jax.Array) -> jax.Array:
    """`x` held with its leading (row) axis split over all the mesh's devices and the rest of each row whole on its
    device, where the devices divide the rows (as it is otherwise): GSPMD then partitions row-wise work on it by
    rows, as `per_device_rows` does explicitly, and keeps what JAX's partitionable random bits give one device."""
    _, rows = _rows_split(x.shape[0])
    return x if rows is None else jax.lax.with_sharding_constraint(x, rows)


def _rows_split(rows: int):
    """(the ambient mesh, the spec splitting a leading axis of `rows` over all its devices), the spec None where
    there is no mesh or its devices do not divide the rows."""
    mesh = sharded_mesh()
    return mesh, (None if mesh is None or rows % mesh.size else P(tuple(mesh.axis_names)))
