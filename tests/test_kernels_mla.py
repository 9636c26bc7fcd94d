"""The MLA decode kernels (model/kernels/mla_decode.py) against XLA's absorbed attention, in interpret mode.

Numbers on CPU (interpret mode) and lowering to Triton IR at Kimi K2.5's shapes (64 heads, latent 512, rope 64);
the GPU timings are bench/attention_lab.py's.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels.mla_decode import MLAKernelConfig, combine_splits, mla_combine, mla_decode_attention
from model.kv_cache import visible_slots

B, S, N, C, R, V = 2, 96, 4, 32, 16, 8
SMALL = MLAKernelConfig(block_q=16, block_s=16, splits=4, num_warps=4, block_c=16)


def _reference_context(q_lat, q_rope, latent, k_rope, positions, scale):
    """The context half of model.attention_mla.attend_absorbed, in float32."""
    s = jnp.einsum("btnc,bsc->bnts", q_lat, latent, preferred_element_type=jnp.float32)
    s += jnp.einsum("btnr,bsr->bnts", q_rope, k_rope, preferred_element_type=jnp.float32)
    s = jnp.where(visible_slots(positions, latent.shape[1])[:, None], s * scale, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bnts,bsc->btnc", p, latent.astype(jnp.float32))


def _inputs(t, positions, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q_lat = jax.random.normal(ks[0], (B, t, N, C), jnp.float32).astype(dtype)
    q_rope = jax.random.normal(ks[1], (B, t, N, R), jnp.float32).astype(dtype)
    latent = jax.random.normal(ks[2], (B, S, C), jnp.float32).astype(dtype)
    k_rope = jax.random.normal(ks[3], (B, S, R), jnp.float32).astype(dtype)
    return q_lat, q_rope, latent, k_rope, jnp.asarray(positions, jnp.int32)


@pytest.mark.parametrize("t, positions, splits, block_q", [
    (1, [[40], [95]], 4, 16),
    (3, [[5, 6, 7], [70, 71, 72]], 2, 16),  # the rows of a block see different slot counts; some splits run empty
    (2, [[0, 1], [16, 17]], 8, 16),  # more splits than visible blocks
    (1, [[40], [95]], 4, 32),  # 32-row blocks (long caches at batch 8): rows padded past T x N
])
def test_both_kernels_match_attention_with_w_uv_float32(t, positions, splits, block_q):
    """Kernel 1 + kernel 2 (combine, normalise) + w_uv == softmax . latent . w_uv^T."""
    q_lat, q_rope, latent, k_rope, pos = _inputs(t, positions, jnp.float32)
    w_uv = jax.random.normal(jax.random.PRNGKey(9), (N, V, C), jnp.float32)
    cfg = dataclasses.replace(SMALL, splits=splits, block_q=block_q)
    out = jax.jit(functools.partial(mla_decode_attention, scale=0.2, cfg=cfg, interpret=True))(
        q_lat, q_rope, latent, k_rope, pos, w_uv)
    ref = jnp.einsum("btnc,nvc->btnv", _reference_context(q_lat, q_rope, latent, k_rope, pos, 0.2), w_uv)
    assert out.shape == (B, t, N, V)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_combine_kernel_matches_plain_combine():
    """Kernel 2 alone against combine_splits + einsum, on random partials with one empty split."""
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    t, x = 2, 4
    o = jax.random.normal(ks[0], (B, x, t * N, C))
    m = jax.random.normal(ks[1], (B, x, t * N)).at[:, 2].set(-1e30)
    l = jax.random.uniform(ks[2], (B, x, t * N), minval=0.5, maxval=2.0).at[:, 2].set(0.0)
    o = o.at[:, 2].set(0.0)
    out = mla_combine(o, m, l, jnp.float32, cfg=SMALL, interpret=True)
    ref = combine_splits(o, m, l)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_kernel_bf16_within_rounding():
    args = _inputs(2, [[30, 31], [90, 91]], jnp.bfloat16, seed=1)
    w_uv = jax.random.normal(jax.random.PRNGKey(2), (N, V, C), jnp.float32)
    out = mla_decode_attention(*args, w_uv, scale=0.15, cfg=dataclasses.replace(SMALL, block_s=32, splits=2),
                               interpret=True)
    assert out.dtype == jnp.bfloat16
    ref = np.asarray(jnp.einsum("btnc,nvc->btnv", _reference_context(*args, 0.15), w_uv))
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-2


def test_attention_path_with_kernel_matches_absorbed():
    """model.attention_mla's "absorbed_kernel" path (k_nope absorbed into q, v out of the context) equals
    "absorbed" (float32); the decoder takes it on a GPU for T <= 16 unless `Kernels(mla="off")`."""
    from model.attention_mla import ATTENTION_PATHS, MLAWeights
    from model.configs import known_config

    dn, dv, t = 8, 12, 3
    cfg = known_config("kimi-k2.5").replace(num_attention_heads=N, kv_lora_rank=C, qk_rope_head_dim=R,
                                            qk_nope_head_dim=dn, v_head_dim=dv)
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    w = MLAWeights(None, None, None, None, None, jax.random.normal(ks[0], (N, C, dn)),
                   jax.random.normal(ks[1], (N, dv, C)), None)
    q_nope = jax.random.normal(ks[2], (B, t, N, dn))
    _, q_rope, latent, k_rope, positions = _inputs(t, [[20, 21, 22], [60, 61, 62]], jnp.float32)
    args = (q_nope, q_rope, latent, k_rope, positions, w, cfg)
    np.testing.assert_allclose(np.asarray(ATTENTION_PATHS["absorbed_kernel"](*args)),
                               np.asarray(ATTENTION_PATHS["absorbed"](*args)), rtol=1e-4, atol=1e-4)


def test_combine_splits_ignores_empty_splits():
    """A split past every row's position keeps max -1e30 and sum 0 and must not change the result."""
    o = jnp.asarray([[[[2.0, 4.0]], [[0.0, 0.0]]]])  # [B=1, X=2, R=1, C=2]
    m = jnp.asarray([[[0.5], [-1e30]]])
    l = jnp.asarray([[[2.0], [0.0]]])
    np.testing.assert_allclose(np.asarray(combine_splits(o, m, l)), [[[1.0, 2.0]]])


def test_capacity_and_splits_are_checked():
    args = _inputs(1, [[3], [4]], jnp.float32)
    w_uv = jnp.zeros((N, V, C))
    with pytest.raises(ValueError, match="block_s"):
        mla_decode_attention(*args, w_uv, scale=0.1, cfg=dataclasses.replace(SMALL, block_s=64), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        mla_decode_attention(*args, w_uv, scale=0.1, cfg=dataclasses.replace(SMALL, splits=3), interpret=True)


@pytest.mark.parametrize("t, paged", [(1, False), (4, False), (1, True), (4, True)])
def test_lowers_to_triton_at_k25_shapes(t, paged):
    """Paged: pools of 64-position pages through a [B, 64] table (a 4096 capacity), no gather outside the kernels."""
    from tests.test_kernels_moe import _pretend_h200

    sds = jax.ShapeDtypeStruct
    b, s, n, c, r, v = 1, 4096, 64, 512, 64, 128
    lead, table = ((300, 64), dict(pages_BM=sds((b, s // 64), jnp.int32))) if paged else ((b, s), {})
    restore = _pretend_h200()
    try:
        lowered = jax.jit(functools.partial(mla_decode_attention, scale=0.1)).trace(
            sds((b, t, n, c), jnp.bfloat16), sds((b, t, n, r), jnp.bfloat16), sds((*lead, c), jnp.bfloat16),
            sds((*lead, r), jnp.bfloat16), sds((b, t), jnp.int32), sds((n, v, c), jnp.bfloat16), **table,
        ).lower(lowering_platforms=("cuda",))
    finally:
        restore()
    text = lowered.as_text()
    assert "mla_partial" in text and "mla_combine" in text
    assert "gather" not in text


def test_kernel_dispatch_rule():
    """GPU only, batch x tokens <= 8, capacity <= 4096 (beyond: decode at batch 8 only) unless `Kernels(mla="on")`
    forces it (T <= 16); "off" turns it off."""
    from model.config import Kernels
    from model.configs import known_config
    from model.kernels.dispatch import mla_kernel_applies

    cfg = known_config("kimi-k2.5")
    auto, on, off = Kernels(), Kernels(mla="on"), Kernels(mla="off")
    assert mla_kernel_applies(auto, 1, 4, 1088, cfg, backend="gpu")
    assert mla_kernel_applies(auto, 8, 1, 1088, cfg, backend="gpu")
    assert not mla_kernel_applies(auto, 8, 4, 1088, cfg, backend="gpu")  # XLA's batched GEMMs measured faster
    assert not mla_kernel_applies(auto, 1, 4, 1088, cfg, backend="cpu")
    assert not mla_kernel_applies(auto, 1, 32, 1088, cfg, backend="gpu")  # prefill
    assert not mla_kernel_applies(auto, 1, 1, 32832, cfg, backend="gpu")  # long cache: XLA as good or better
    assert mla_kernel_applies(auto, 8, 1, 32832, cfg, backend="gpu")  # ... but at batch 8 the 32-row tiles win
    assert not mla_kernel_applies(auto, 4, 2, 32832, cfg, backend="gpu")  # verify over a long cache: XLA
    assert not mla_kernel_applies(auto, 1, 1, 1000, cfg, backend="gpu")  # not a multiple of the kernel's blocks
    assert mla_kernel_applies(on, 1, 1, 32832, cfg, backend="gpu")
    assert mla_kernel_applies(on, 8, 4, 1088, cfg, backend="gpu")
    assert not mla_kernel_applies(on, 1, 32, 1088, cfg, backend="gpu")  # never for prefill
    assert not mla_kernel_applies(off, 1, 1, 1088, cfg, backend="gpu")
    # a paged cache's other path gathers its whole capacity first: from 2048 slots the kernels take every batch
    assert mla_kernel_applies(auto, 64, 4, 4096, cfg, backend="gpu", page_tokens=64)
    assert mla_kernel_applies(auto, 16, 1, 2048, cfg, backend="gpu", page_tokens=64)
    assert not mla_kernel_applies(auto, 64, 4, 4096, cfg, backend="gpu")  # unpaged: XLA
    assert not mla_kernel_applies(auto, 64, 4, 1024, cfg, backend="gpu", page_tokens=64)  # short: gather + XLA
    assert not mla_kernel_applies(auto, 16, 4, 8192, cfg, backend="gpu", page_tokens=64)  # not measured beyond 4096
    assert not mla_kernel_applies(auto, 64, 32, 4096, cfg, backend="gpu", page_tokens=64)  # never for prefill


def test_kernel_config_is_validated():
    from model.config import ConfigError, Kernels

    with pytest.raises(ConfigError, match="kernels.mla='maybe'"):
        Kernels(mla="maybe")
    with pytest.raises(ConfigError, match="kernels.moe"):
        Kernels(moe="on")


def test_tiles_by_shape():
    """Decode keeps the default tiles; verify steps (more than 64 rows) split by capacity, as measured."""
    from model.kernels.mla_decode import MLAKernelConfig, config_for

    assert config_for(1088, 512, 64) == MLAKernelConfig()
    assert config_for(32832, 512, 64) == MLAKernelConfig()
    assert config_for(1088, 512, 64, batch=8) == MLAKernelConfig()
    long_b8 = config_for(32832, 512, 64, batch=8)  # decode at batch 8 over a long cache: 32-row blocks
    assert (long_b8.block_q, long_b8.splits) == (32, 16)
    verify_1k = config_for(1088, 512, 4 * 64)
    assert (verify_1k.block_q, verify_1k.splits) == (16, 8)
    verify_4k = config_for(4160, 512, 4 * 64)
    assert (verify_4k.block_q, verify_4k.splits) == (32, 16)
    assert config_for(48, 32, 4 * 64).block_s == 16  # small test caches still get blocks that divide them


# --- a paged cache (model.kv_cache): the kernels read each block of slots from its page through the block table ---
PAGE = 32  # positions a page: S = 96 is 3 pages


def _scrambled_pool(x_BSX, held_pages, spare_pages, seed):
    """`x_BSX`'s first held_pages[b] pages of each sequence b, stored in a pool [N, PAGE, X] in random page order
    among `spare_pages` pages of noise no sequence holds; the block table [B, S / PAGE] holds N past a sequence's
    pages. -> (pool_NPX, pages_BM)."""
    b, s, x = x_BSX.shape
    m = s // PAGE
    n = sum(held_pages) + spare_pages
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    pool_NPX = np.asarray(rng.standard_normal((n, PAGE, x)), np.float32).astype(x_BSX.dtype)
    pages_BM = np.full((b, m), n, np.int32)
    taken = 0
    for i, held in enumerate(held_pages):
        for j in range(held):
            pages_BM[i, j] = order[taken]
            pool_NPX[order[taken]] = np.asarray(x_BSX[i, j * PAGE:(j + 1) * PAGE])
            taken += 1
    return jnp.asarray(pool_NPX), jnp.asarray(pages_BM)


@pytest.mark.parametrize("t", [1, 4])
def test_paged_kernel_equals_contiguous_kernel_and_plain_attention(t):
    """Four sequences over one pool in scrambled page order: one long (3 pages), one short (1 page), one in its
    second page (2 pages, then N), and an idle slot holding no page (its output is discarded: only finite). The
    paged kernel equals the contiguous kernel on the gathered view, and `attend_absorbed` on it."""
    from model.attention_mla import ATTENTION_PATHS, MLAWeights
    from model.configs import known_config
    from model.kv_cache import read_pages

    b, dn, dv = 4, 8, V
    ends = [90, 20, 50, 70]  # the last query position of each sequence
    held = [3, 1, 2, 0]
    ks = jax.random.split(jax.random.PRNGKey(11 + t), 5)
    latent_BSC = jax.random.normal(ks[0], (b, S, C))
    k_rope_BSR = jax.random.normal(ks[1], (b, S, R))
    latent_pool_NPC, pages_BM = _scrambled_pool(latent_BSC, held, spare_pages=3, seed=t)
    k_rope_pool_NPR, pages_again_BM = _scrambled_pool(k_rope_BSR, held, spare_pages=3, seed=t)
    assert (pages_BM == pages_again_BM).all()
    latent_view_BSC, k_rope_view_BSR = read_pages(latent_pool_NPC, pages_BM), read_pages(k_rope_pool_NPR, pages_BM)
    positions_BT = jnp.asarray([[e - t + 1 + i for i in range(t)] for e in ends], jnp.int32)
    cfg = known_config("kimi-k2.5").replace(num_attention_heads=N, kv_lora_rank=C, qk_rope_head_dim=R,
                                            qk_nope_head_dim=dn, v_head_dim=dv)
    w = MLAWeights(None, None, None, None, None, jax.random.normal(ks[2], (N, C, dn)),
                   jax.random.normal(ks[3], (N, dv, C)), None)
    q_nope_BTND = jax.random.normal(ks[4], (b, t, N, dn))
    q_rope_BTNR = jax.random.normal(jax.random.fold_in(ks[4], 1), (b, t, N, R))
    q_lat_BTNC = jnp.einsum("btnd,ncd->btnc", q_nope_BTND, w.w_uk)
    kernel = jax.jit(functools.partial(mla_decode_attention, scale=cfg.softmax_scale, cfg=SMALL, interpret=True))

    paged = kernel(q_lat_BTNC, q_rope_BTNR, latent_pool_NPC, k_rope_pool_NPR, positions_BT, w.w_uv,
                   pages_BM=pages_BM)
    contiguous = kernel(q_lat_BTNC, q_rope_BTNR, latent_view_BSC, k_rope_view_BSR, positions_BT, w.w_uv)
    plain = ATTENTION_PATHS["absorbed"](q_nope_BTND, q_rope_BTNR, latent_view_BSC, k_rope_view_BSR, positions_BT, w,
                                        cfg)
    live = slice(0, 3)
    # the same blocks in the same order: the same numbers
    np.testing.assert_array_equal(np.asarray(paged[live]), np.asarray(contiguous[live]))
    np.testing.assert_allclose(np.asarray(paged[live]), np.asarray(plain[live]), rtol=1e-4, atol=1e-4)
    assert np.isfinite(np.asarray(paged[3])).all()


def test_paged_blocks_must_tile_the_pages():
    """A block of slots must lie in one page: the kernel refuses a block_s that does not divide the page, and the
    dispatch does not take the kernels for such a cache (mla then gathers the pages for the plain path)."""
    from model.config import Kernels
    from model.configs import known_config
    from model.kernels.dispatch import mla_kernel_applies

    q_lat, q_rope, _, _, positions = _inputs(1, [[3], [4]], jnp.float32)
    pool_NPC, pool_NPR = jnp.zeros((5, 24, C)), jnp.zeros((5, 24, R))
    pages_BM = jnp.asarray([[0, 1], [2, 5]], jnp.int32)  # capacity 48: a multiple of block_s 16, its pages not
    with pytest.raises(ValueError, match="does not divide the cache's pages of 24"):
        mla_decode_attention(q_lat, q_rope, pool_NPC, pool_NPR, positions, jnp.zeros((N, V, C)), scale=0.1,
                             cfg=SMALL, interpret=True, pages_BM=pages_BM)
    cfg, on = known_config("kimi-k2.5"), Kernels(mla="on")
    assert mla_kernel_applies(on, 8, 1, 17 * 64, cfg, backend="gpu", page_tokens=64)
    assert not mla_kernel_applies(on, 8, 1, 34 * 32, cfg, backend="gpu", page_tokens=32)  # 64-slot blocks


@pytest.mark.parametrize("t", [1, 4])
def test_mla_layer_on_a_paged_cache_reads_pages_in_the_kernel(t, monkeypatch):
    """model.attention_mla.mla with a paged cache and the kernels forced on (as on a GPU, interpret mode here): the
    kernels read the pools through the table, no contiguous copy is gathered, and the layer's output and written
    cache equal the contiguous cache's under the plain path."""
    import model.attention_mla as attention_mla
    from model.config import Kernels
    from model.configs import known_config
    from model.init import init_kimi_weights
    from model.kernels import dispatch
    from model.kv_cache import read_pages
    from model.rope import cos_sin, target_rope_tables

    h, b = 64, 3
    cfg = known_config("kimi-k2.5").replace(hidden_size=h, num_attention_heads=N, q_lora_rank=32, kv_lora_rank=C,
                                            qk_nope_head_dim=8, qk_rope_head_dim=R, v_head_dim=V,
                                            intermediate_size=64, num_hidden_layers=1, aux_layer_ids=None)
    w = init_kimi_weights(cfg, np.random.default_rng(0), jnp.float32).layers[0].attn
    latent_pool_NPC, pages_BM = _scrambled_pool(jax.random.normal(jax.random.PRNGKey(1), (b, S, C)), [3, 1, 2],
                                                spare_pages=2, seed=7)
    k_rope_pool_NPR, _ = _scrambled_pool(jax.random.normal(jax.random.PRNGKey(2), (b, S, R)), [3, 1, 2],
                                         spare_pages=2, seed=7)
    positions_BT = jnp.asarray([[e - t + 1 + i for i in range(t)] for e in (95, 28, 61)], jnp.int32)
    x_BTH = jax.random.normal(jax.random.PRNGKey(3), (b, t, h))
    inv_freq, multiplier = target_rope_tables(cfg)
    cos, sin = cos_sin(positions_BT, inv_freq, multiplier)

    latent_BSC, k_rope_BSR = read_pages(latent_pool_NPC, pages_BM), read_pages(k_rope_pool_NPR, pages_BM)

    gathered = []
    monkeypatch.setattr(attention_mla, "read_pages", lambda *a: gathered.append(a) or read_pages(*a))
    monkeypatch.setattr(attention_mla, "mla_kernel_applies",
                        functools.partial(dispatch.mla_kernel_applies, backend="gpu"))

    def layer(kernels, latent, k_rope, pages_BM=None):
        layer_cfg = cfg.replace(kernels=Kernels(mla=kernels))
        return attention_mla.mla(x_BTH, w, layer_cfg, cos, sin, positions_BT, latent, k_rope, pages_BM=pages_BM)

    out_BTH, latent_pool_NPC, k_rope_pool_NPR = jax.jit(functools.partial(layer, "on"))(
        latent_pool_NPC, k_rope_pool_NPR, pages_BM)
    assert not gathered
    want_BTH, latent_BSC, k_rope_BSR = jax.jit(functools.partial(layer, "off"))(latent_BSC, k_rope_BSR)
    np.testing.assert_allclose(np.asarray(out_BTH), np.asarray(want_BTH), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(read_pages(latent_pool_NPC, pages_BM)), np.asarray(latent_BSC))
    np.testing.assert_array_equal(np.asarray(read_pages(k_rope_pool_NPR, pages_BM)), np.asarray(k_rope_BSR))


def test_a_device_of_eight_heads_passes_its_query_unpadded():
    """One device of the 8-way mesh holds 8 heads: at one token its 8 query rows are fewer than a 16-row block, and
    on a GPU the kernel loads the block with the missing rows masked (no pad before the kernel)."""
    from model.kernels.target import compiling_for
    from tests.test_kernels_moe import _pretend_h200

    sds = jax.ShapeDtypeStruct
    b, s, n, c, r, v = 1, 1024, 8, 512, 64, 128
    restore = _pretend_h200()
    try:
        with compiling_for("gpu", "9.0"):
            text = jax.jit(functools.partial(mla_decode_attention, scale=0.1)).trace(
                sds((b, 1, n, c), jnp.bfloat16), sds((b, 1, n, r), jnp.bfloat16), sds((b, s, c), jnp.bfloat16),
                sds((b, s, r), jnp.bfloat16), sds((b, 1), jnp.int32), sds((n, v, c), jnp.bfloat16),
            ).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        restore()
    assert "mla_partial" in text and "stablehlo.pad" not in text
    assert f"tensor<{b}x{n}x{c}xbf16>" in text  # the query as the device holds it, not 16 rows
