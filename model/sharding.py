"""Partition rules: one table from weight paths to logical axes, one from logical axes to mesh axes.

Mesh axes are ("data", "model"). Routed experts are split over every device (expert parallel);
attention heads, the dense MLP, the shared expert, embeddings and lm_head are tensor parallel over
"model"; batch rides "data"; the EAGLE-3 draft is replicated. A dimension that the mesh axes do not
divide is replicated instead (tiny test models), so any mesh shape runs any model.

TARGET_RULES / DRAFT_RULES place weights (the engine, convert's loader and the planner all read them),
CACHE_RULES / STATE_RULES the caches and the engine's state; model/moe_parallel.py splits the expert
computation by the same "experts" entry (`expert_axes`).
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "model")

LOGICAL_TO_MESH = {
    "batch": "data",
    "vocab": "model",
    "heads": "model",
    "ffn": "model",
    "experts": ("data", "model"),
}

# (regex over the weight's path, logical axes of its dims); first match wins; unmatched -> replicated.
TARGET_RULES: tuple[tuple[str, tuple], ...] = (
    (r"^embed$", ("vocab", None)),
    (r"^lm_head$", ("vocab", None)),
    (r"\.attn\.(q_b_proj|w_uk|w_uv)$", ("heads", None, None)),
    (r"\.attn\.o_proj$", (None, "heads", None)),
    (r"\.mlp\.experts\.(gate|up|down)(\.packed|\.scale|\.weight|\.scale_inv)?$", ("experts", None, None)),
    (r"\.mlp(\.shared)?\.(gate|up)$", ("ffn", None)),
    (r"\.mlp(\.shared)?\.down$", (None, "ffn")),
)

# The EAGLE-3 draft is small next to the target: every device holds all of it.
DRAFT_RULES: tuple[tuple[str, tuple], ...] = ()

# Caches alone (a LatentCache / DraftCache) or inside the engine's state (`target_cache.latent.3`, ...). A paged
# cache's pools (the target's [N, P, C|R] per layer, the draft's [N, Nkv, P, D] or [N, P, C|R]) match the same
# rules: the page axis stands where the batch axis stood and rides "data" as it would, for the target's pools and
# the draft's alike, so a page id means the same shard in both; the one block table (`target_cache.pages_BM`,
# which the draft reads too) matches none and is replicated.
CACHE_RULES: tuple[tuple[str, tuple], ...] = (
    (r"(^|\.)(latent|k_rope)\.\d+$", ("batch", None, None)),  # target MLA latent cache [B, S, C|R]
    (r"(^|draft_cache\.)(k|v)$", ("batch", None, None, None)),  # draft KV cache [B, Nkv, S, D]
    (r"(^|draft_cache\.)(latent|k_rope)$", ("batch", None, None)),  # MLA draft latent cache [B, S, C|R]
    (r"(^|\.)lengths$", ("batch",)),
)

# The engine's state between cycles: caches, plus the draft's carried activations. The bookkeeping
# (tokens out, counters, done flags, the PRNG key) matches no rule and stays replicated: it is tiny,
# and a replicated array can be read back by every process of a multi-host run.
STATE_RULES: tuple[tuple[str, tuple], ...] = CACHE_RULES + (
    (r"(^|\.)(draft_logits|draft_hidden)$", ("batch", None)),
)


def parse_mesh_spec(spec: str) -> tuple[int, int]:
    """"8" (a device count: 1 x 8) or "2x4" (data x model) -> (data, model); ValueError otherwise."""
    try:
        dims = tuple(int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"not a mesh spec: {spec!r}") from None
    if len(dims) not in (1, 2) or min(dims) < 1:
        raise ValueError(f"not a mesh spec: {spec!r}")
    return (1, dims[0]) if len(dims) == 1 else dims


def make_mesh(shape: tuple[int, int] | int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh; an int n means (1, n); None means all devices as (1, n)."""
    devices = list(jax.devices() if devices is None else devices)
    if shape is None:
        shape = (1, len(devices))
    elif isinstance(shape, int):
        shape = (1, shape)
    n = int(np.prod(shape))
    if n > len(devices):
        raise ValueError(f"mesh {shape} needs {n} devices, {len(devices)} available")
    return Mesh(np.array(devices[:n]).reshape(shape), MESH_AXES)


def path_str(path) -> str:
    parts = []
    for k in path:
        if hasattr(k, "name"):
            parts.append(str(k.name))
        elif hasattr(k, "key"):
            parts.append(str(k.key))
        elif hasattr(k, "idx"):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return ".".join(parts)


def _mesh_size(mesh: Mesh, axes) -> int:
    axes = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[a] for a in axes]))


def spec_for(logical: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`mesh` may be a Mesh or an AbstractMesh (the planner sizes meshes it does not have)."""
    dims = []
    for i, size in enumerate(shape):
        name = logical[i] if i < len(logical) else None
        axes = LOGICAL_TO_MESH.get(name) if name else None
        if axes is not None and size % _mesh_size(mesh, axes) == 0:
            dims.append(axes)
        else:
            dims.append(None)
    return P(*dims)


def _match(rules, path: str):
    for pattern, logical in rules:
        if re.search(pattern, path):
            return logical
    return ()


def specs_for(tree, mesh: Mesh, rules=TARGET_RULES):
    """A pytree of PartitionSpec matching `tree` (arrays or ShapeDtypeStructs)."""
    def one(path, leaf):
        return spec_for(_match(rules, path_str(path)), tuple(leaf.shape), mesh)

    return jax.tree_util.tree_map_with_path(one, tree)


def shardings_for(tree, mesh: Mesh, rules=TARGET_RULES):
    """A pytree of NamedSharding matching `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs_for(tree, mesh, rules),
                                  is_leaf=lambda x: isinstance(x, P))


def shard_shape(spec: P, shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
    """The shape of one device's shard of a `shape` array split by `spec` (specs_for divides evenly)."""
    out = list(shape)
    for i, axes in enumerate(spec):
        if axes is not None:
            out[i] //= _mesh_size(mesh, axes)
    return tuple(out)


def expert_axes(num_experts: int, mesh: Mesh) -> tuple[str, ...] | None:
    """The mesh axes that split the routed experts (the same rule TARGET_RULES applies), None if none do."""
    axes = spec_for(("experts",), (num_experts,), mesh)[0]
    if axes is None:
        return None
    axes = axes if isinstance(axes, tuple) else (axes,)
    return axes if _mesh_size(mesh, axes) > 1 else None


def mesh_context(mesh: Mesh):
    """Make `mesh` the ambient mesh while tracing (shard_map inside the model finds it there)."""
    if hasattr(jax, "set_mesh"):
        return jax.set_mesh(mesh)
    return jax.sharding.use_mesh(mesh)  # pragma: no cover - jax < 0.7


def replicated(tree, mesh: Mesh):
    return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), tree)


def shard(tree, shardings):
    return jax.tree_util.tree_map(jax.device_put, tree, shardings)


def ambient_mesh():
    """The abstract mesh of the enclosing `jax.set_mesh` (None without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh

