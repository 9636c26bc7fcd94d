"""Pytrees <-> sharded .npz files of flattened leaves (what travels back from a device run).

Each leaf is stored under its `jax.tree_util.keystr` path; bfloat16 is stored as its uint16 bit pattern
(numpy has no bf16) with the true dtype in `<name>.dtypes.json`. Shards stay under `shard_bytes` so each
file fits the device tool's per-file limit. Loading fills a template pytree (from `jax.eval_shape`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

_BIT_VIEWS = {"bfloat16": np.uint16}


def _leaves_by_key(tree) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def save_flat(directory: str | Path, name: str, tree, shard_bytes: int = 12 << 20) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = _leaves_by_key(tree)
    dtypes = {k: str(a.dtype) for k, a in arrays.items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, a in arrays.items():
        stored = a.view(_BIT_VIEWS[str(a.dtype)]) if str(a.dtype) in _BIT_VIEWS else a
        if shards[-1] and size + stored.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = stored
        size += stored.nbytes
    paths = []
    for i, shard in enumerate(shards):
        path = directory / f"{name}-{i:05d}.npz"
        np.savez(path, **shard)
        paths.append(path)
    (directory / f"{name}.dtypes.json").write_text(json.dumps(dtypes, indent=0))
    return paths


def load_flat(directory: str | Path, name: str, template):
    """Fill `template` (a pytree of arrays or ShapeDtypeStructs) from the shards; shapes must match."""
    directory = Path(directory)
    dtypes = json.loads((directory / f"{name}.dtypes.json").read_text())
    stored: dict[str, np.ndarray] = {}
    for path in sorted(directory.glob(f"{name}-*.npz")):
        with np.load(path) as z:
            stored.update({k: z[k] for k in z.files})
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, want in flat:
        key = jax.tree_util.keystr(path)
        if key not in stored:
            raise KeyError(f"{directory}/{name}: no array for {key}")
        a = stored[key]
        if dtypes[key] in _BIT_VIEWS:
            a = a.view(getattr(ml_dtypes, dtypes[key]))
        if tuple(a.shape) != tuple(want.shape):
            raise ValueError(f"{directory}/{name}: {key} has shape {a.shape}, expected {tuple(want.shape)}")
        leaves.append(jnp.asarray(a))
    return jax.tree_util.tree_unflatten(treedef, leaves)
