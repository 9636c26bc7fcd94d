"""Kernels in sharded programs (model/shard_local.py): on 8 simulated CPU devices, the MLA decode kernels and the
router's kernels run per device inside shard_map (interpret mode here) and equal the plain XLA reference, with no
collective of their own; the dispatch rules read one device's batch and heads; per_device_rows runs a row-wise
computation on each device's rows and equals it whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from model.attention_mla import MLAWeights, attend_absorbed, attend_absorbed_kernel
from model.config import Kernels
from model.configs import known_config
from model.kernels.dispatch import mla_kernel_applies
from model.kernels.target import compiling_for
from model.kv_cache import read_pages
from model.router import route
from model.shard_local import held_to_rules, held_whole, per_device_rows
from model.sharding import make_mesh, mesh_context

B, T, N, D, C, R, V, S = 2, 2, 8, 16, 32, 16, 16, 64
CFG = known_config("kimi-k2.5").replace(num_attention_heads=N, kv_lora_rank=C, qk_rope_head_dim=R, qk_nope_head_dim=D,
                                        v_head_dim=V)


def attention_inputs(seed=0, s=S):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q_nope = jax.random.normal(ks[0], (B, T, N, D), jnp.float32)
    q_rope = jax.random.normal(ks[1], (B, T, N, R), jnp.float32)
    latent = jax.random.normal(ks[2], (B, s, C), jnp.float32)
    k_rope = jax.random.normal(ks[3], (B, s, R), jnp.float32)
    w = MLAWeights(q_a_proj=None, q_a_norm=None, q_b_proj=jnp.zeros((N, D + R, 8)), kv_a_proj=None,
                   kv_a_norm=jnp.ones((C,)), w_uk=jax.random.normal(ks[4], (N, C, D)) * D ** -0.5,
                   w_uv=jax.random.normal(ks[5], (N, V, C)) * C ** -0.5, o_proj=jnp.zeros((8, N, V)))
    positions = jnp.asarray([[20, 21], [50, 51]], jnp.int32)
    return q_nope, q_rope, latent, k_rope, positions, w


def place(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_mla_kernels_run_per_device_and_equal_xla(shape):
    """Heads split over "model", batch rows over "data": each device's kernels attend with its heads over its rows'
    caches; the result equals XLA's absorbed attention and the program gathers nothing."""
    q_nope, q_rope, latent, k_rope, positions, w = attention_inputs()
    want = attend_absorbed(q_nope, q_rope, latent, k_rope, positions, w, CFG)
    mesh = make_mesh(shape)
    args = (place(mesh, q_nope, "data", None, "model", None), place(mesh, q_rope, "data", None, "model", None),
            place(mesh, latent, "data", None, None), place(mesh, k_rope, "data", None, None),
            place(mesh, positions, "data", None))
    w = w.replace(w_uk=place(mesh, w.w_uk, "model", None, None), w_uv=place(mesh, w.w_uv, "model", None, None))
    fn = jax.jit(lambda *a: attend_absorbed_kernel(*a, w, CFG))
    with mesh_context(mesh):
        assert "shard_map" in str(jax.make_jaxpr(fn)(*args))
        got = fn(*args)
        text = fn.lower(*args).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert "all-gather" not in text and "all-reduce" not in text


def test_paged_mla_kernels_run_per_device_and_equal_xla():
    """A paged cache on a 1 x 8 mesh: every device reads the pools through the whole table with its own heads."""
    q_nope, q_rope, latent, k_rope, positions, w = attention_inputs(1, s=128)
    page = 64  # the kernels' blocks of 64 slots lie in one page each
    pages_BM = jnp.asarray([[3, 0], [2, 1]], jnp.int32)  # 2 pages a sequence, 4 in the pool
    pool_latent = jnp.zeros((4, page, C)).at[pages_BM.reshape(-1)].set(latent.reshape(B * 2, page, C))
    pool_rope = jnp.zeros((4, page, R)).at[pages_BM.reshape(-1)].set(k_rope.reshape(B * 2, page, R))
    np.testing.assert_array_equal(np.asarray(read_pages(pool_latent, pages_BM)), np.asarray(latent))
    want = attend_absorbed(q_nope, q_rope, latent, k_rope, positions, w, CFG)
    mesh = make_mesh((1, 8))
    w = w.replace(w_uk=place(mesh, w.w_uk, "model", None, None), w_uv=place(mesh, w.w_uv, "model", None, None))
    fn = jax.jit(lambda q, qr, pl, pr, pos, table: attend_absorbed_kernel(q, qr, pl, pr, pos, w, CFG, pages_BM=table))
    with mesh_context(mesh):
        got = fn(place(mesh, q_nope, None, None, "model", None), place(mesh, q_rope, None, None, "model", None),
                 pool_latent, pool_rope, positions, pages_BM)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tokens", [1, 4])  # 4: the router GEMV's partial sums
def test_router_kernels_run_per_device_and_equal_xla(tokens):
    cfg = known_config("kimi-k2.5").replace(n_routed_experts=32, num_experts_per_tok=4, hidden_size=64)
    ks = jax.random.split(jax.random.PRNGKey(tokens), 3)
    x = jax.random.normal(ks[0], (tokens, 64))
    router, bias = jax.random.normal(ks[1], (32, 64)) * 0.2, jax.random.normal(ks[2], (32,)) * 0.05
    want = route(x, router, bias, cfg.replace(kernels=Kernels(router="off")))
    on = cfg.replace(kernels=Kernels(router="on"))
    with mesh_context(make_mesh((2, 4))):
        assert "shard_map" in str(jax.make_jaxpr(lambda *a: route(*a, on))(x, router, bias))
        got = jax.jit(lambda *a: route(*a, on))(x, router, bias)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-7)


def test_mla_dispatch_reads_one_devices_batch_and_heads():
    """"auto" takes the kernels up to 8 query rows a device: batch 16 is too many on one device, 8 a device on a
    2 x 4 mesh; a paged cache's table is global, so a mesh with a "data" axis keeps XLA's path."""
    cfg = known_config("kimi-k2.5")
    applies = lambda batch, **kw: mla_kernel_applies(Kernels(), batch, 1, 1024, cfg, backend="gpu", **kw)  # noqa: E731
    assert applies(8) and not applies(16) and applies(4, page_tokens=64)
    with mesh_context(make_mesh((2, 4))):
        assert applies(16)
        assert not applies(4, page_tokens=64)
    with mesh_context(make_mesh((1, 8))):
        assert applies(4, page_tokens=64)


def test_sharded_mla_lowers_to_gpu_kernels_at_local_shapes():
    """Lowered for CUDA under a 2 x 4 mesh (as the sharded engine's program is), the MLA kernels are Triton calls
    on one device's block (batch 1 of 2, heads 2 of 8) inside the manual region, and nothing is gathered."""
    from tests.test_kernels_moe import _pretend_h200

    q_nope, q_rope, latent, k_rope, positions, w = attention_inputs()
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)  # noqa: E731
    restore = _pretend_h200()
    try:
        with compiling_for("gpu", "9.0"), mesh_context(make_mesh((2, 4))):  # the kernels, not their interpret mode
            text = jax.jit(lambda *a: attend_absorbed_kernel(*a, w, CFG)).trace(
                sds(q_nope), sds(q_rope), sds(latent), sds(k_rope), positions).lower(
                lowering_platforms=("cuda",)).as_text()
    finally:
        restore()
    assert text.count("triton") >= 2 and "all_gather" not in text
    assert f"tensor<1x{T}x{N // 4}x{C}xbf16>" in text  # q_lat as one device holds it


@pytest.mark.parametrize("rows", [8, 16, 6])  # 6: the devices do not divide the rows
def test_per_device_rows_runs_each_devices_rows_and_equals_the_whole(rows):
    """A row-wise computation along a vocabulary-split axis (a sort and a running sum, as sampling's processing)
    over rows split by per_device_rows equals it over the whole array; the rows split over every device of the
    mesh where they divide, and the computation is left as it is where they do not."""
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 3, 64))
    scale = jnp.linspace(0.5, 2.0, rows)

    def row_wise(x_RXV, scale_R):
        return jnp.cumsum(-jnp.sort(-x_RXV, axis=-1), axis=-1) * scale_R[:, None, None]

    want = row_wise(x, scale)
    mesh = make_mesh((2, 4))
    vocab_split = NamedSharding(mesh, P(None, None, "model"))
    with mesh_context(mesh):
        traced = str(jax.make_jaxpr(lambda *a: per_device_rows(row_wise, *a))(x, scale))
        assert ("shard_map" in traced) == (rows % 8 == 0)
        got = jax.jit(lambda x, s: per_device_rows(row_wise, held_to_rules(x, (None, None, "vocab")), held_whole(s)))(
            jax.device_put(x, vocab_split), scale)
    if rows % 8 == 0:  # each device runs the whole rows it holds as one device would: the same floats
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.spec[0] == ("data", "model")
    else:  # GSPMD's own partitioning of the sum along the split axis: its float order
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


def test_held_to_rules_is_the_value_itself_without_a_mesh():
    x = jnp.arange(12.0).reshape(3, 4)
    assert held_to_rules(x, (None, "vocab")) is x
    assert held_whole((x,))[0] is x
    assert per_device_rows(lambda a: a * 2, x).tolist() == (x * 2).tolist()
