"""Checkpoint format versions: v2 stores each MLA layer's w_uk as [N, C, Dn]; a v1 checkpoint ([N, Dn, C], as
every conversion before v2 wrote it) still loads, transposed on load, on one device, on a mesh and in check mode."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.checkpoint import (FORMAT_VERSION, METADATA_FILE, OPTIONS_FILE, CheckpointWriter, load_item_numpy,
                                load_target, partial_dir, save_target)
from convert.safetensors_reader import CheckpointError
from model.init import init_kimi_weights
from model.sharding import make_mesh
from tests.tiny_models import tiny_target_config


def _mark_v1(path) -> None:
    """Mark a checkpoint as format v1 (the caller saved its w_uk as v1 stored it, [N, Dn, C])."""
    meta_file = path / METADATA_FILE
    meta = json.loads(meta_file.read_text())
    meta["format_version"] = 1
    meta_file.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    cfg = tiny_target_config()
    w = init_kimi_weights(cfg, jax.random.key(3), jnp.float32)
    save_target(root / "v2", w, cfg)
    v1_layers = tuple(lw.replace(attn=lw.attn.replace(w_uk=jnp.swapaxes(lw.attn.w_uk, 1, 2))) for lw in w.layers)
    save_target(root / "v1", w.replace(layers=v1_layers), cfg)
    _mark_v1(root / "v1")
    return root, cfg, w


def _assert_same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_v2_stores_w_uk_contracting_axis_minor(checkpoints):
    root, cfg, w = checkpoints
    assert json.loads((root / "v2" / METADATA_FILE).read_text())["format_version"] == FORMAT_VERSION == 2
    _, got = load_target(root / "v2", dtype="stored")
    n, c, dn = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    assert got.layers[0].attn.w_uk.shape == (n, c, dn)
    _assert_same(got, w)


def test_v1_checkpoint_loads_transposed(checkpoints):
    root, _, w = checkpoints
    _, v1 = load_target(root / "v1", dtype="stored")
    _assert_same(v1, w)


def test_v1_checkpoint_loads_on_a_mesh(checkpoints):
    root, _, w = checkpoints
    mesh = make_mesh()
    _, v1 = load_target(root / "v1", mesh, dtype="stored")
    _, v2 = load_target(root / "v2", mesh, dtype="stored")
    _assert_same(v1, w)
    for a, b in zip(v1.layers, v2.layers):
        assert a.attn.w_uk.sharding.is_equivalent_to(b.attn.w_uk.sharding, a.attn.w_uk.ndim)


def test_v1_checkpoint_in_check_mode(checkpoints):
    root, _, _ = checkpoints
    _assert_same(load_item_numpy(root / "v1", "layer_001"), load_item_numpy(root / "v2", "layer_001"))


def test_unknown_version_is_refused(checkpoints, tmp_path):
    root, cfg, w = checkpoints
    dst = save_target(tmp_path / "future", w, cfg)
    meta = json.loads((dst / METADATA_FILE).read_text())
    meta["format_version"] = 99
    (dst / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"jaxspec_checkpoint.json: format 'jaxspec-checkpoint' v99 is not"):
        load_target(dst)


def test_partial_conversion_of_another_version_is_not_resumed(tmp_path):
    dst = tmp_path / "out"
    CheckpointWriter(dst, {"kind": "target"})
    opts = partial_dir(dst) / OPTIONS_FILE
    started = json.loads(opts.read_text())
    assert started["format_version"] == FORMAT_VERSION
    started.pop("format_version")  # what a v1 converter left behind
    opts.write_text(json.dumps(started))
    with pytest.raises(CheckpointError, match="pass --restart"):
        CheckpointWriter(dst, {"kind": "target"})
