"""q_a and kv_a as one weight (model.attention_mla.fuse_input_projections), the layout the engines run: the forward
gives the unfused forward's logits and cache, the fusion leaves what it cannot fuse alone, and the engines hold the
fused weight (replicated on a mesh) without copying weights already in their layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.checkpoint import load_draft, load_target, save_draft, save_target
from jaxspec.engine import Engine
from jaxspec.sampling import SamplingParams
from model.attention_mla import fuse_input_projections
from model.decoder import forward, fuse_attention_inputs
from model.eagle3 import DraftConfig
from model.init import init_draft_weights, init_kimi_weights
from model.kv_cache import init_latent_cache
from model.quant import Fp8Weight
from model.sharding import make_mesh
from tests.tiny_models import tiny_pair, tiny_target_config


def _forward(w, cfg, tokens_BT):
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = forward(w, cfg, tokens_BT, positions_BT, init_latent_cache(cfg, b, 16, jnp.float32))
    return out.logits, out.cache


@pytest.mark.parametrize("t", [1, 5])
def test_fused_forward_equals_separate(t):
    cfg = tiny_target_config()
    w = init_kimi_weights(cfg, np.random.default_rng(7), jnp.float32)
    fused = fuse_attention_inputs(w)
    attn = fused.layers[1].attn
    q, x = cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert attn.q_a_proj is None and attn.kv_a_proj is None and attn.qkv_a_proj.shape == (q + x, cfg.hidden_size)
    np.testing.assert_array_equal(attn.qkv_a_proj[:q], w.layers[1].attn.q_a_proj)
    np.testing.assert_array_equal(attn.qkv_a_proj[q:], w.layers[1].attn.kv_a_proj)
    tokens = jax.random.randint(jax.random.key(1), (2, t), 0, cfg.vocab_size)
    want_logits, want_cache = _forward(w, cfg, tokens)
    got_logits, got_cache = _forward(fused, cfg, tokens)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(got_cache), jax.tree_util.tree_leaves(want_cache)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fusion_is_idempotent_and_leaves_what_it_cannot_fuse():
    cfg = tiny_target_config()
    attn = init_kimi_weights(cfg, np.random.default_rng(2), jnp.float32).layers[0].attn
    fused = fuse_input_projections(attn)
    assert fuse_input_projections(fused) is fused
    # without q-LoRA there is no q_a to fuse
    no_lora = init_kimi_weights(tiny_target_config(q_lora_rank=None), np.random.default_rng(2), jnp.float32)
    assert fuse_input_projections(no_lora.layers[0].attn) is no_lora.layers[0].attn
    # an FP8 q_a's [128, 128] block scales do not tile a concatenation with kv_a, and two dtypes do not concatenate
    fp8 = attn.replace(q_a_proj=Fp8Weight(attn.q_a_proj.astype(jnp.float8_e4m3fn), jnp.ones((1, 1), jnp.float32),
                                          (128, 128)))
    assert fuse_input_projections(fp8) is fp8
    mixed = attn.replace(kv_a_proj=attn.kv_a_proj.astype(jnp.bfloat16))
    assert fuse_input_projections(mixed) is mixed


def test_engine_runs_fused_weights_with_the_same_tokens():
    cfg, w = tiny_pair(seed=4)
    prompt = [3, 9, 1, 7]
    eng = Engine(cfg, w, num_steps=2)
    assert all(lw.attn.qkv_a_proj is not None and lw.attn.q_a_proj is None for lw in eng.weights.target.layers)
    assert w.target.layers[0].attn.q_a_proj is not None  # the caller's weights are not changed
    got = eng.generate([prompt], max_new_tokens=6, sampling=SamplingParams())
    unfused = jax.jit(lambda w, t, p, c: forward(w, cfg.target, t, p, c).logits)
    # greedy decoding by the plain unfused forward, one token at a time over the whole sequence
    seq = list(prompt)
    for _ in range(6):
        tokens = jnp.asarray([seq], jnp.int32)
        positions = jnp.arange(len(seq), dtype=jnp.int32)[None]
        logits = unfused(w.target, tokens, positions, init_latent_cache(cfg.target, 1, 32, jnp.float32))
        seq.append(int(jnp.argmax(logits[0, -1])))
    assert got.tokens[0] == seq[len(prompt):]


def test_engine_on_a_mesh_keeps_the_fused_weight_replicated():
    cfg, w = tiny_pair(seed=5)
    eng = Engine(cfg, w, num_steps=2, mesh=make_mesh((2, 4)))
    fused = eng.weights.target.layers[1].attn.qkv_a_proj
    assert fused.sharding.is_fully_replicated and len(fused.sharding.device_set) == 8
    again = Engine(cfg, eng.weights, num_steps=2, mesh=eng.mesh)  # already in the run layout: nothing copied
    assert again.weights.target.layers[1].attn.qkv_a_proj is fused


def test_checkpoints_store_the_two_weights_apart(tmp_path):
    """Weights in the run layout saved as a checkpoint come back as Hugging Face lays them out (target and MLA
    draft), so `convert check` and every reader see the stored format."""
    cfg = tiny_target_config()
    w = init_kimi_weights(cfg, np.random.default_rng(9), jnp.float32)
    save_target(tmp_path / "t", fuse_attention_inputs(w), cfg)
    _, back = load_target(tmp_path / "t", dtype="stored")
    assert back.layers[1].attn.qkv_a_proj is None
    _assert_same(back, w)
    dcfg = DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=12,
                       intermediate_size=32, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size,
                       rope_theta=50000.0, rms_norm_eps=1e-5, aux_layer_ids=(0, 1, 2), attention="mla",
                       q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    dw = init_draft_weights(dcfg, np.random.default_rng(10), jnp.float32)
    save_draft(tmp_path / "d", dw.replace(mla=fuse_input_projections(dw.mla)), dcfg)
    _, dback = load_draft(tmp_path / "d", dtype="stored")
    assert dback.mla.qkv_a_proj is None and dback.mla.q_a_proj is not None
    _assert_same(dback, dw)


def _assert_same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
