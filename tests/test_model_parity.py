"""The Flax/JAX Kimi model against HF transformers DeepseekV3ForCausalLM (float32, tiny random configs)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.hf_weights import load_kimi_weights
from convert.safetensors_reader import CheckpointReader
from model.config import load_text_config
from model.decoder import forward
from model.kv_cache import init_latent_cache
from tests.hf_tiny import hf_logits, make_hf_model, save_hf_model

TOL = 1e-4

VARIANTS = {
    # K2.5 YaRN (betas 32/1); positions are pushed far past original_max_position_embeddings (32)
    "k25_yarn": dict(),
    "k2_yarn_betas_1_1": dict(rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=32,
                                                beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                              max_position_embeddings=1024),
    "groups_4_top2": dict(n_group=4, topk_group=2),
    # two dense layers and unnormalised top-k weights: features of separate code paths, checked in one model
    "dense_first_2_no_topk_norm": dict(first_k_dense_replace=2, norm_topk_prob=False),
}

jit_forward = jax.jit(forward, static_argnames=("cfg", "attention"))


def _load(tmp_path, **overrides):
    hf = make_hf_model(seed=len(overrides), **overrides)
    d = save_hf_model(hf, tmp_path / "ckpt")
    cfg = load_text_config(d).replace(aux_layer_ids=(0, 1, 2))
    w = load_kimi_weights(CheckpointReader(d), cfg, dtype=jnp.float32)
    return hf, cfg, w


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    return (request.param, *_load(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param]))


def _tokens(batch, t, seed=0):
    return np.random.default_rng(seed).integers(3, 96, size=(batch, t))


SEQ = 56  # positions 0..55: past original_max_position_embeddings (32), where YaRN interpolates


def test_full_sequence_logits_and_aux(variant):
    name, hf, cfg, w = variant
    b = 2
    tokens = _tokens(b, SEQ)
    positions = np.broadcast_to(np.arange(SEQ), (b, SEQ))
    ref_logits, ref_hidden = hf_logits(hf, tokens)
    cache = init_latent_cache(cfg, b, SEQ + 8, jnp.float32)
    out = jit_forward(w, cfg, jnp.asarray(tokens), jnp.asarray(positions), cache)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=TOL, rtol=0)
    # HF hidden_states[i + 1] is the residual stream leaving layer i (its last entry is after the final norm)
    want_aux = np.concatenate([ref_hidden[i + 1] for i in cfg.eagle_aux_layers], axis=-1)
    np.testing.assert_allclose(np.asarray(out.aux_hidden), want_aux, atol=TOL, rtol=0)


def test_incremental_decode_matches_full_forward(variant):
    """Prefill 8 tokens, then feed 1 token (decode) and 4 tokens (verify width) at a time, alternately, through the
    cache: each width runs at positions on both sides of original_max_position_embeddings (32)."""
    name, hf, cfg, w = variant
    b, prefill = 2, 8
    tokens = _tokens(b, SEQ, seed=1)
    ref_logits, _ = hf_logits(hf, tokens)
    cache = init_latent_cache(cfg, b, SEQ + 8, jnp.float32)
    spans, start = [(0, prefill)], prefill
    while start < SEQ:
        chunk = 4 if len(spans) % 2 == 0 and start + 4 <= SEQ else 1
        spans.append((start, start + chunk))
        start += chunk
    assert {stop - start for start, stop in spans[1:]} == {1, 4}
    got = []
    for start, stop in spans:
        pos = np.broadcast_to(np.arange(start, stop), (b, stop - start))
        out = jit_forward(w, cfg, jnp.asarray(tokens[:, start:stop]), jnp.asarray(pos), cache)
        cache = out.cache
        got.append(np.asarray(out.logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), ref_logits, atol=TOL, rtol=0)


def test_absorbed_equals_decompressed(variant):
    name, hf, cfg, w = variant
    b = 2
    tokens = jnp.asarray(_tokens(b, SEQ, seed=2))
    positions = jnp.broadcast_to(jnp.arange(SEQ), (b, SEQ))
    cache = init_latent_cache(cfg, b, SEQ + 8, jnp.float32)  # the other tests' shapes: "absorbed" is compiled once
    assert inspect.signature(forward).parameters["attention"].default == "absorbed"
    a = jit_forward(w, cfg, tokens, positions, cache)  # the default path (as in the other tests: compiled once)
    d = jit_forward(w, cfg, tokens, positions, cache, attention="decompressed")
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(d.logits), atol=1e-5, rtol=0)


def test_padding_and_stale_slots_are_invisible(variant):
    """Garbage past a sequence's length (prefill padding, rejected drafts) never changes its logits."""
    name, hf, cfg, w = variant
    b, real = 2, 8
    tokens = _tokens(b, SEQ, seed=3)
    ref_logits, _ = hf_logits(hf, tokens[:, :real])
    # the other tests' shapes (T = SEQ and T = 8 over SEQ + 8 slots), so no program is compiled for this test alone
    cache = init_latent_cache(cfg, b, SEQ + 8, jnp.float32)
    # write SEQ tokens, of which only the first 8 are "real"; then rewrite 0..7 while slots 8.. hold the others
    pos = jnp.broadcast_to(jnp.arange(SEQ), (b, SEQ))
    cache = jit_forward(w, cfg, jnp.asarray(tokens), pos, cache).cache
    out = jit_forward(w, cfg, jnp.asarray(tokens[:, :real]), pos[:, :real], cache)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=TOL, rtol=0)
