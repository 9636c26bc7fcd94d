"""Pieces of the converter: host dequantization against compressed-tensors and model.quant, save_* / load_*
of in-memory weights on several mesh shapes, and the config round trip used by save_*."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from convert.checkpoint import load_draft, load_target, save_draft, save_target
from convert.dequantize_numpy import dequantize_fp8_block, dequantize_int4_group, unpack_int4_words
from convert.hf_config import draft_config_to_hf, text_config_to_hf
from model.config import text_config_from_dict
from model.eagle3 import draft_config_from_dict
from model.init import init_draft_weights, init_kimi_weights
from model.quant import Fp8Weight, Int4Weight, dequantize
from model.sharding import make_mesh
from tests import convert_fixtures as fx
from tests.hf_tiny import tiny_config_dict

CONFIGS = fx.REPO / "model" / "configs"


def test_int4_unpack_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = torch.randint(-8, 8, (24, 64), dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    assert packed.dtype == torch.int32 and (packed < 0).any()  # high nibbles >= 8 make negative words
    ours = unpack_int4_words(packed.numpy())
    np.testing.assert_array_equal(ours, q.numpy())
    np.testing.assert_array_equal(ours, unpack_from_int32(packed, 4, torch.Size([24, 64])).numpy())


def test_int4_dequant_matches_model_quant():
    w = torch.randn(48, 64)
    packed, scale, deq = fx.int4_group_quantize(w, 32)
    scale_np = scale.float().numpy().astype(ml_dtypes.bfloat16)
    ours = dequantize_int4_group(packed.numpy(), scale_np)
    np.testing.assert_array_equal(ours, deq.numpy())
    model = dequantize(Int4Weight(jnp.asarray(packed.numpy().view(np.uint32)), jnp.asarray(scale_np)), jnp.float32)
    np.testing.assert_array_equal(ours, np.asarray(model))


@pytest.mark.parametrize("shape", [(64, 32), (40, 72)])  # whole blocks, and ceil-div edge blocks
def test_fp8_block_dequant(shape):
    w = torch.randn(*shape)
    q, s, deq = fx.fp8_block_quantize(w, (16, 16))
    ours = dequantize_fp8_block(q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), s.numpy(), (16, 16))
    np.testing.assert_array_equal(ours, deq.numpy())
    i, j = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    per_element = q.float().numpy() * s.numpy()[i // 16, j // 16]
    np.testing.assert_array_equal(ours, per_element)
    # model.quant's device dequantization, edge blocks included (the block size is stated, not inferred)
    fp8 = Fp8Weight(jnp.asarray(q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)), jnp.asarray(s.numpy()),
                    (16, 16))
    np.testing.assert_array_equal(ours, np.asarray(dequantize(fp8, jnp.float32)))


@pytest.mark.parametrize("name", ["kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"])
def test_config_round_trip(name):
    cfg = text_config_from_dict(json.loads((CONFIGS / f"{name}.json").read_text()))
    back = text_config_from_dict(text_config_to_hf(cfg))
    assert back == cfg.replace(weight_prefix="", quant=None)


def _tiny_text_config(**kw):
    raw = {"architectures": ["DeepseekV3ForCausalLM"], **tiny_config_dict(num_attention_heads=8, num_key_value_heads=8,
                                                                           num_hidden_layers=2, **kw)}
    return text_config_from_dict(raw)


def random_like(abstract_tree, seed=0):
    """Random numpy weights in the layout `init_*` defines (eager jax init is slow to dispatch on CPU)."""
    rng = np.random.default_rng(seed)

    def one(s):
        if s.dtype == jnp.uint32:
            return rng.integers(0, 2**32, size=s.shape, dtype=np.uint32)
        if jnp.issubdtype(s.dtype, jnp.integer):
            return rng.integers(0, 4, size=s.shape).astype(s.dtype)
        return rng.standard_normal(s.shape).astype(s.dtype)

    return jax.tree_util.tree_map(one, abstract_tree)


@pytest.mark.parametrize("mesh_shape", [1, (2, 4)])
def test_save_target_from_memory_round_trips_on_mesh(tmp_path, mesh_shape):
    """What a training script does: save in-memory (INT4-expert) weights, load them onto a mesh."""
    cfg = _tiny_text_config()
    w = random_like(jax.eval_shape(lambda: init_kimi_weights(cfg, jax.random.PRNGKey(0), jnp.bfloat16, experts="int4")))
    path = save_target(tmp_path / "target", w, cfg, tokenizer_dir=None)
    mesh = make_mesh(mesh_shape)
    got_cfg, got = load_target(path, mesh, dtype="stored")
    assert got_cfg == cfg.replace(quant=None)
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree_util.tree_leaves(got)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(p)
    packed = got.layers[1].mlp.experts.down.packed
    assert packed.sharding.mesh.shape == dict(zip(("data", "model"), mesh.devices.shape))
    assert packed.sharding.spec == P(("data", "model"), None, None)  # 16 experts split over every device


def test_save_draft_from_memory_round_trips(tmp_path):
    dcfg = draft_config_from_dict({**fx.DRAFT_TINY, "architectures": ["LlamaForCausalLMEagle3"],
                                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}})
    assert draft_config_from_dict(draft_config_to_hf(dcfg)) == dcfg
    d2t = np.arange(dcfg.draft_vocab_size) * 2 - np.arange(dcfg.draft_vocab_size)
    w = random_like(jax.eval_shape(lambda: init_draft_weights(dcfg, jax.random.PRNGKey(1), jnp.bfloat16, d2t=d2t)))
    w = w.replace(d2t=d2t.astype(np.int32))
    w = jax.device_put(w, jax.sharding.NamedSharding(make_mesh(), P()))  # training holds sharded jax arrays
    path = save_draft(tmp_path / "draft", w, dcfg)
    got_cfg, got = load_draft(path, make_mesh(), dtype=jnp.float32)
    assert got_cfg == dcfg and got.embed is None and got.d2t.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got.d2t), d2t)
    np.testing.assert_array_equal(np.asarray(got.q_proj), np.asarray(w.q_proj, np.float32))
    assert got.q_proj.dtype == jnp.float32 and got.q_proj.sharding.spec == P()
