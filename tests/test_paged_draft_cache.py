"""The EAGLE-3 draft's cache paged: pools read through a block table. A paged draft forward equals a contiguous one
(Llama draft, head-major pools, and MLA draft)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import SpecConfig, SpecWeights
from model.eagle3 import DraftConfig, draft_forward, init_draft_cache, init_paged_draft_cache
from model.init import init_draft_weights, init_kimi_weights
from model.kv_cache import read_head_major_pages, read_pages
from tests.sharded_pair import numpy_like
from tests.tiny_models import tiny_target_config

P = 64
DRAFTS = ("llama", "mla")


def _draft_config(target, attention: str) -> DraftConfig:
    common = dict(hidden_size=target.hidden_size, intermediate_size=48, vocab_size=target.vocab_size,
                  draft_vocab_size=target.vocab_size, rope_theta=10000.0, rms_norm_eps=1e-6,
                  aux_layer_ids=target.aux_layer_ids)
    if attention == "llama":  # grouped heads: two kv heads in each page of the head-major pools
        return DraftConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8, **common)
    return DraftConfig(num_attention_heads=2, num_key_value_heads=2, head_dim=12, attention="mla", q_lora_rank=16,
                       kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, **common)


@pytest.fixture(scope="module", params=DRAFTS)
def pair(request):
    """A tiny target and a random draft of each attention, sharp enough for stable greedy tokens."""
    cfg = tiny_target_config(64, num_hidden_layers=3)
    dcfg = _draft_config(cfg, request.param)
    target = jax.eval_shape(lambda k: init_kimi_weights(cfg, k, jnp.float32), jax.random.key(0))
    draft = jax.eval_shape(lambda k: init_draft_weights(dcfg, k, jnp.float32), jax.random.key(0))
    return SpecConfig(cfg, dcfg, ()), SpecWeights(numpy_like(target, 0), numpy_like(draft, 1))


def _contiguous_view(cache, pages_BM):
    """A paged draft cache's arrays as each sequence's contiguous cache."""
    if hasattr(cache, "k"):
        return read_head_major_pages(cache.k, pages_BM), read_head_major_pages(cache.v, pages_BM)
    return read_pages(cache.latent, pages_BM), read_pages(cache.k_rope, pages_BM)


def test_a_paged_draft_forward_equals_a_contiguous_one(pair):
    cfg, w = pair
    dcfg, tw = cfg.draft, w.target
    pages_BM = jnp.array([[3, 1], [0, 5]], jnp.int32)  # sequence 1 holds one page (5: none)
    contiguous = init_draft_cache(dcfg, 2, 2 * P, jnp.float32)
    paged = init_paged_draft_cache(dcfg, 5, P, jnp.float32)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 60, size=(2, 70)), jnp.int32)
    aux = jnp.asarray(rng.standard_normal((2, 70, dcfg.aux_width)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(70, dtype=jnp.int32), (2, 70))
    positions = positions.at[1].set(jnp.minimum(positions[1], 40))  # sequence 1 stays within its page

    @jax.jit
    def both(tokens, h, positions, contiguous, paged):
        run = lambda cache, table=None: draft_forward(w.draft, dcfg, tw.embed, tw.lm_head, tokens, h,  # noqa: E731
                                                      positions, cache, table)
        return run(contiguous), run(paged, pages_BM)

    want, got = both(tokens, aux, positions, contiguous, paged)
    for _ in range(3):  # draft ahead on its own output, reading what the steps before wrote
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
        nxt = jnp.argmax(want.logits[:, -1:], axis=-1).astype(jnp.int32)
        positions = positions[:, -1:] + 1
        want, got = both(nxt, want.hidden[:, -1:], positions, want.cache, got.cache)
    # read back, the pages are the contiguous cache (sequence 1 wrote nothing past its page)
    for view, c in zip(_contiguous_view(got.cache, pages_BM), jax.tree.leaves(want.cache)):
        np.testing.assert_allclose(view, c, rtol=1e-6, atol=1e-6)
    for pool in jax.tree.leaves(got.cache):  # pages no sequence holds were never written
        assert not np.asarray(pool[jnp.array([2, 4])]).any()
