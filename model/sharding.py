"""Partition rules: one table from weight paths to logical axes, one from logical axes to mesh axes.

Mesh axes are ("data", "model"). Routed experts are split over every device (expert parallel);
attention heads, the dense MLP, the shared expert, embeddings and lm_head are tensor parallel over
"model"; batch rides "data"; the EAGLE-3 draft is replicated. A dimension that the mesh axes do not
divide is replicated instead (tiny test models), so any mesh shape runs any model.
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

CACHE_RULES: tuple[tuple[str, tuple], ...] = (
    (r"^(latent|k_rope)\.\d+$", ("batch", None, None)),
    (r"^lengths$", ("batch",)),
)


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


def shardings_for(tree, mesh: Mesh, rules=TARGET_RULES):
    """A pytree of NamedSharding matching `tree` (arrays or ShapeDtypeStructs)."""
    def one(path, leaf):
        return NamedSharding(mesh, spec_for(_match(rules, path_str(path)), tuple(leaf.shape), mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def replicated(tree, mesh: Mesh):
    return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), tree)


def shard(tree, shardings):
    return jax.tree_util.tree_map(jax.device_put, tree, shardings)
