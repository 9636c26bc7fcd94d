"""The top-k routing kernel (model/kernels/router_topk.py) against `model.router.route`'s XLA path (interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import Kernels
from model.configs import known_config
from model.kernels.dispatch import router_kernel_applies
from model.kernels.router_topk import route_topk
from model.router import route as model_route


def route(x, router, bias, cfg, topk):
    """`model.router.route` with the top-k kernel on ("kernel", interpret mode here) or off ("xla")."""
    return model_route(x, router, bias, cfg.replace(kernels=Kernels(router="on" if topk == "kernel" else "off")))


@pytest.mark.parametrize("experts, k, norm, tokens", [(384, 8, True, 4), (24, 3, False, 5), (16, 4, True, 1),
                                                             (16, 4, True, 20)])  # 20: XLA logits, kernel top-k
def test_route_kernel_equals_xla_route(experts, k, norm, tokens):
    cfg = known_config("kimi-k2.5").replace(n_routed_experts=experts, num_experts_per_tok=k, norm_topk_prob=norm,
                                            hidden_size=32)
    ks = jax.random.split(jax.random.PRNGKey(experts + k), 3)
    x = jax.random.normal(ks[0], (tokens, 32))
    router = jax.random.normal(ks[1], (experts, 32)) * 0.2
    bias = jax.random.normal(ks[2], (experts,)) * 0.05
    w_ref, ids_ref = route(x, router, bias, cfg, "xla")
    w, ids = route(x, router, bias, cfg, "kernel")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-6, atol=1e-7)
    assert w.shape == (tokens, k) and ids.dtype == jnp.int32


def test_ties_go_to_the_lowest_index_like_lax_top_k():
    logits = jnp.zeros((2, 16)).at[0, 5].set(3.0).at[1, 9].set(-3.0)  # mostly equal scores
    bias = jnp.zeros((16,))
    w, ids = route_topk(logits, bias, 4, False, 1.0, True)
    _, ref = jax.lax.top_k(jax.nn.sigmoid(logits), 4)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref))
    assert ids[0, 0] == 5 and 9 not in np.asarray(ids[1])


def test_kernel_route_has_the_xla_gradient():
    """Training differentiates through the routing weights: the kernel's custom VJP gives XLA's gradient."""
    cfg = known_config("kimi-k2.5").replace(n_routed_experts=24, num_experts_per_tok=4, hidden_size=16)
    ks = jax.random.split(jax.random.PRNGKey(4), 4)
    x, router = jax.random.normal(ks[0], (3, 16)), jax.random.normal(ks[1], (24, 16)) * 0.3
    bias, probe = jax.random.normal(ks[2], (24,)) * 0.05, jax.random.normal(ks[3], (3, 4))

    def loss(x, router, bias, topk):
        w, _ = route(x, router, bias, cfg, topk)
        return jnp.sum(w * probe)

    # one backward pass per path gives all three gradients
    grads_ref = jax.grad(loss, argnums=(0, 1, 2))(x, router, bias, "xla")
    grads = jax.grad(loss, argnums=(0, 1, 2))(x, router, bias, "kernel")
    for g, g_ref in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)


def test_group_limited_routing_stays_on_xla():
    """The kernel routes one expert group: with n_group > 1 even `router="on"` runs the XLA path."""
    cfg = known_config("kimi-k2.5").replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=2,
                                            hidden_size=8)
    assert not router_kernel_applies(Kernels(router="on"), 1, cfg)
    assert router_kernel_applies(Kernels(router="on"), 1, cfg.replace(n_group=1, topk_group=1))
    x, router, bias = jnp.ones((1, 8)), jnp.ones((16, 8)), jnp.zeros((16,))
    for got, want in zip(route(x, router, bias, cfg, "kernel"), route(x, router, bias, cfg, "xla")):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_lowers_to_triton_at_k25_shapes():
    from tests.test_kernels_moe import _pretend_h200

    restore = _pretend_h200()
    try:
        lowered = jax.jit(lambda lg, b: route_topk(lg, b, 8, True, 2.827)).trace(
            jax.ShapeDtypeStruct((4, 384), jnp.float32), jax.ShapeDtypeStruct((384,), jnp.float32),
        ).lower(lowering_platforms=("cuda",))
    finally:
        restore()
    assert "router_topk" in lowered.as_text()


def test_router_gemv_partials_sum_to_the_logits():
    """Several E blocks and H splits (32 experts, H = 512: blocks of 16 rows, two splits of 256; interpret mode runs
    each block op by op, so the smallest shapes that have several of both)."""
    from model.kernels.router_gemv import router_logit_partials, tiles
    from model.router import router_logits

    assert tiles(48, 1024) == (16, 256, 4) and tiles(384, 7168) == (16, 256, 28)
    assert tiles(32, 512) == (16, 256, 2)
    ks = jax.random.split(jax.random.PRNGKey(21), 2)
    x = jax.random.normal(ks[0], (4, 512)).astype(jnp.bfloat16)
    router = jax.random.normal(ks[1], (32, 512)) * 0.03
    partials = jax.jit(router_logit_partials, static_argnums=2)(x, router, True)
    assert partials.shape == (2, 4, 32)
    np.testing.assert_allclose(np.asarray(partials.sum(0)), np.asarray(router_logits(x, router)), rtol=1e-5, atol=1e-5)
    cfg = known_config("kimi-k2.5").replace(n_routed_experts=32, hidden_size=512)
    w_ref, ids_ref = route(x, router, jnp.zeros((32,)), cfg, "xla")
    w, ids = route(x, router, jnp.zeros((32,)), cfg, "kernel")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-5)
    with pytest.raises(ValueError, match="at most 8 tokens"):
        router_logit_partials(jnp.zeros((9, 512)), router, True)

    probe = jax.random.normal(jax.random.PRNGKey(22), (4, cfg.num_experts_per_tok))

    def loss(x, router, topk):
        return jnp.sum(route(x, router, jnp.zeros((32,)), cfg, topk)[0] * probe)

    xf = x.astype(jnp.float32)  # each split's cotangent reaches its own chunk of H (two splits here)
    grads_ref = jax.grad(loss, argnums=(0, 1))(xf, router, "xla")
    grads = jax.grad(loss, argnums=(0, 1))(xf, router, "kernel")
    for g, g_ref in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-6)


def test_router_gemv_lowers_to_triton_at_k25_shapes():
    from model.kernels.router_gemv import router_logit_partials
    from tests.test_kernels_moe import _pretend_h200

    restore = _pretend_h200()
    try:
        lowered = jax.jit(lambda x, r: router_logit_partials(x, r)).trace(
            jax.ShapeDtypeStruct((4, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((384, 7168), jnp.float32),
        ).lower(lowering_platforms=("cuda",))
    finally:
        restore()
    assert "router_gemv" in lowered.as_text()
