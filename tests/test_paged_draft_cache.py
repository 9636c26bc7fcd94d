"""The EAGLE-3 draft's cache paged with the target's (`SlotEngine(cache_pages=...)`): pools read through the target
cache's block table. A paged draft forward equals a contiguous one (Llama draft, head-major pools, and MLA draft);
an insert puts the prefilled draft cache into the slot's pages, whatever their ids; slots on paged caches draft,
accept and answer as unpaged ones across a page boundary mid-step; the draft cache's memory is its pool's, and its
pools are placed on a mesh as the target's."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.sampling import SamplingParams
from jaxspec.serving.slot_engine import SlotEngine
from jaxspec.serving.slots import init_slots, insert_prefilled
from model.eagle3 import DraftConfig, draft_forward, init_draft_cache, init_paged_draft_cache
from model.init import init_draft_weights, init_kimi_weights
from model.kv_cache import init_latent_cache, read_head_major_pages, read_pages
from model.sharding import STATE_RULES, make_mesh, specs_for
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


def test_an_insert_puts_the_prefilled_draft_cache_into_the_slots_pages(pair):
    """Scrambled page ids: page m of the batch-1 prefill's draft cache lands in pool page pages_M[m], for the
    target's and the draft's caches alike; the slot's table row names them, other pages stay empty."""
    cfg, w = pair
    capacity, pages = 3 * P, 7
    slots = init_slots(cfg, w, 2, capacity, jnp.float32, with_draft=True, cache_pages=pages, page_tokens=P)
    rng = np.random.default_rng(2)
    rand = lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)  # noqa: E731
    one = types.SimpleNamespace(
        target_cache=jax.tree.map(rand, init_latent_cache(cfg.target, 1, capacity, jnp.float32)),
        draft_cache=jax.tree.map(rand, init_draft_cache(cfg.draft, 1, capacity, jnp.float32)),
        pending=jnp.array([5], jnp.int32), draft_logits=jnp.zeros((1, cfg.draft.draft_vocab_size), jnp.float32),
        draft_hidden=jnp.zeros((1, cfg.draft.hidden_size), jnp.float32), key=jax.random.key(3))
    pages_M = jnp.array([4, 0, 6], jnp.int32)
    after = insert_prefilled(slots, one, jnp.int32(1), jnp.int32(8), True, jnp.float32(1), jnp.int32(0),
                             jnp.float32(1), pages_M, eos_ids=())
    table = after.target_cache.pages_BM
    np.testing.assert_array_equal(table, [[pages] * 3, [4, 0, 6]])
    for got, want in zip(_contiguous_view(after.draft_cache, table), jax.tree.leaves(one.draft_cache)):
        np.testing.assert_array_equal(got[1], want[0])
    np.testing.assert_array_equal(read_pages(after.target_cache.latent[2], table)[1], one.target_cache.latent[2][0])
    for pool in jax.tree.leaves(after.draft_cache):
        assert not np.asarray(pool[jnp.array([1, 2, 3, 5])]).any()


def _run(engine, prompts, max_new):
    """Both prompts in their slots at once, stepped to the end: per step the tokens, accepted drafts and the
    draft's carried logits of the live slots."""
    for slot, prompt in enumerate(prompts):
        engine.prefill(slot, prompt, max_new, SamplingParams(), seed=slot)
    steps, busy = [], set(range(len(prompts)))
    while busy:
        result = engine.step(np.zeros((engine.max_batch,), bool), any_sampled=False)
        live = sorted(busy)
        steps.append(([result.tokens[s] for s in live], result.accepted,
                      np.asarray(engine.state.draft_logits)[live]))
        busy = {s for s in busy if not result.done[s]}
    return steps


def test_slots_on_paged_caches_draft_and_answer_as_unpaged_ones(pair):
    """Greedy float32: the second prompt's answer crosses from its first page into its second during a device
    step; the tokens, the drafts accepted and the draft's next proposal of every step equal an unpaged engine's."""
    cfg, w = pair
    kw = dict(num_steps=2, max_batch=2, max_context=128, cycles_per_step=2)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 60, size=n)] for s, n in ((1, 40), (2, 60))]
    want = _run(SlotEngine(cfg, w, **kw), prompts, 12)
    paged = SlotEngine(cfg, w, cache_pages=5, **kw)
    got = _run(paged, prompts, 12)
    assert len(got) == len(want) and sum(len(t) for t in got[0][0]) > 0
    for (tokens, accepted, logits), (tokens_w, accepted_w, logits_w) in zip(got, want):
        assert (tokens, accepted) == (tokens_w, accepted_w)
        np.testing.assert_allclose(logits, logits_w, rtol=1e-5, atol=1e-5)
    assert sum(a for _, a, _ in want) > 0  # the draft's proposals mattered
    assert isinstance(paged.state.draft_cache, type(init_paged_draft_cache(cfg.draft, 1, P)))


@pytest.mark.parametrize("attention", DRAFTS)
def test_the_draft_cache_costs_its_pool_and_is_placed_as_the_targets(attention):
    """Bytes follow the pool, not max_batch x capacity; on a 2 x 4 mesh the draft's pools split their page axis
    as the target's pools do, and the one block table is the target cache's."""
    cfg = tiny_target_config(64, num_hidden_layers=3)
    scfg = SpecConfig(cfg, _draft_config(cfg, attention), ())
    w = types.SimpleNamespace(target=types.SimpleNamespace(lm_head=jnp.zeros((64, 32)), embed=jnp.zeros((64, 32))),
                              draft=types.SimpleNamespace(lm_head=None, embed=None))

    def draft_bytes(**kw):
        state = jax.eval_shape(lambda: init_slots(scfg, w, 8, 16 * P, jnp.bfloat16, with_draft=True, **kw))
        return state, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.draft_cache))

    contiguous, full = draft_bytes()
    paged, pooled = draft_bytes(cache_pages=6, page_tokens=P)
    assert full == 8 * 16 * pooled // 6  # 8 slots x 16 pages against a pool of 6
    assert {x.shape[0] for x in jax.tree.leaves(paged.draft_cache)} == {6}
    mesh = make_mesh((2, 4))
    specs = specs_for(paged, mesh, STATE_RULES)
    target_spec = specs.target_cache.latent[0]
    assert target_spec[0] == "data"
    for spec in jax.tree.leaves(specs.draft_cache, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
        assert spec[0] == target_spec[0] and all(axis is None for axis in spec[1:])
    assert not hasattr(paged.draft_cache, "pages_BM")
