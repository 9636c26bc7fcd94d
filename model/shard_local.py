"""Kernels in a sharded program: each device runs a Pallas kernel over its own block, inside shard_map.

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

from jax.sharding import PartitionSpec as P

from model.sharding import ambient_mesh, spec_for

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
