"""A JSON description of a weight pytree (node types, shapes, dtypes), saved beside each orbax item.

Orbax stores the arrays of an item as a flat {path: array} dict; the schema says how to rebuild the
model's dataclasses around them (INT4 vs FP8 vs dense experts, dense vs MoE layers, optional q-LoRA)
and gives the abstract tree that shardings are computed from before a single byte is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from model.attention_mla import MLAWeights
from model.decoder import KimiWeights, LayerWeights
from model.eagle3 import DraftWeights
from model.mlp import MLPWeights
from model.moe import ExpertWeights, MoEWeights
from model.quant import Fp8Weight, Int4Weight
from model.sharding import path_str

NODE_TYPES = {
    cls.__name__: cls
    for cls in (KimiWeights, LayerWeights, MLAWeights, MLPWeights, MoEWeights, ExpertWeights, Int4Weight, Fp8Weight, DraftWeights)
}


def describe(tree) -> Any:
    """Pytree of arrays (numpy or jax) -> JSON-able schema."""
    if tree is None:
        return None
    if type(tree).__name__ in NODE_TYPES and dataclasses.is_dataclass(tree):
        fields = {
            f.name: {"static": getattr(tree, f.name)} if not f.metadata.get("pytree_node", True)
            else describe(getattr(tree, f.name))
            for f in dataclasses.fields(tree)
        }
        return {"node": type(tree).__name__, "fields": fields}
    if isinstance(tree, dict):
        return {"node": "dict", "fields": {str(k): describe(v) for k, v in tree.items()}}
    if isinstance(tree, (tuple, list)):
        return {"node": "tuple", "items": [describe(v) for v in tree]}
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return {"shape": [int(d) for d in tree.shape], "dtype": np.dtype(tree.dtype).name}
    raise TypeError(f"cannot describe a {type(tree).__name__} in a weight tree")


def build(schema, leaf: Callable[[tuple[int, ...], np.dtype], Any]):
    """Schema -> pytree with `leaf(shape, dtype)` at every array position."""
    if schema is None:
        return None
    if "shape" in schema:
        return leaf(tuple(schema["shape"]), np.dtype(schema["dtype"]))
    if "static" in schema:  # a dataclass field that is not a pytree node (Fp8Weight.block_size)
        v = schema["static"]
        return tuple(v) if isinstance(v, list) else v
    node = schema["node"]
    if node == "tuple":
        return tuple(build(s, leaf) for s in schema["items"])
    fields = {k: build(v, leaf) for k, v in schema["fields"].items()}
    if node == "dict":
        return fields
    if node not in NODE_TYPES:
        raise ValueError(f"unknown node type {node!r} in a checkpoint schema")
    return NODE_TYPES[node](**fields)


def abstract(schema):
    return build(schema, lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype))


def flat_arrays(tree) -> dict[str, Any]:
    """{"attn.q_b_proj": array, "mlp.experts.gate.packed": array, ...}: what orbax stores for an item."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        return {}
    return {path_str(p) or "value": x for p, x in leaves}


def unflatten(like, flat: dict[str, Any]):
    """Rebuild `like`'s structure from `flat_arrays`-style values."""
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[path_str(p) or "value"] for p, _ in paths_leaves])
