"""The fused RMSNorm kernel (model/kernels/rms_norm.py) against its reference `model.norms.add_rms_norm`
(interpret mode), in the decoder (`Kernels(norm="on")` against "off"), in training's gradients, and lowered to
Triton at Kimi-K2.5's widths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ConfigError, Kernels
from model.decoder import forward
from model.kernels.dispatch import NORM_KERNEL_MAX_ROWS, norm_kernel_applies
from model.kernels.rms_norm import NormJob, fused_rms_norms
from model.kv_cache import init_latent_cache
from model.norms import add_rms_norm
from tests.tiny_models import tiny_pair


def _jobs(dtype, rows=3, seed=0):
    """A residual add + norm over 96 columns (pieces 64 + 32), a 48-wide norm (q_a's role) and a norm of the first
    32 of 40 columns (kv_a's role: the rope key rides after the latent)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    normal = lambda k, shape, s=1.0: (s * jax.random.normal(k, shape)).astype(dtype)  # noqa: E731
    return (NormJob(normal(ks[0], (rows, 96), 3.0), normal(ks[1], (rows, 96)), 1 + normal(ks[2], (96,), 0.1)),
            NormJob(normal(ks[3], (rows, 48)), None, 1 + normal(ks[4], (48,), 0.1)),
            NormJob(normal(ks[5], (rows, 40), 0.2), None, jnp.full((32,), 0.5, dtype)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_reference(dtype):
    """The sums are the same adds (exact); the norms differ only in the mean's summation order: float32 to 1e-6,
    bfloat16 to one rounding of the output (the scale lands on either side of a bf16 step)."""
    jobs = _jobs(dtype)
    got = jax.jit(fused_rms_norms, static_argnums=(1, 2))(jobs, 1e-6, True)
    want = tuple(add_rms_norm(*j, 1e-6) for j in jobs)
    assert got[1][0] is None and got[2][0] is None and got[2][1].shape == (3, 32)
    np.testing.assert_array_equal(np.asarray(got[0][0]), np.asarray(want[0][0]))
    for (_, normed), (_, ref) in zip(got, want, strict=True):
        assert normed.dtype == ref.dtype and normed.shape == ref.shape
        tol = 1e-6 if dtype == jnp.float32 else 2 ** -7
        np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)


def test_rows_must_agree():
    x, w = jnp.ones((3, 8)), jnp.ones((8,))
    with pytest.raises(ValueError, match="rows"):
        fused_rms_norms((NormJob(x, None, w), NormJob(jnp.ones((2, 8)), None, w)), 1e-6, True)
    with pytest.raises(ValueError, match="weight"):
        fused_rms_norms((NormJob(x, None, jnp.ones((9,))),), 1e-6, True)


def test_gradients_are_the_reference_s():
    """Training on a GPU differentiates through the kernel: its custom VJP gives the reference's gradient."""
    jobs = _jobs(jnp.float32, seed=1)
    probes = [jax.random.normal(jax.random.PRNGKey(i), (3, n)) for i, n in enumerate((96, 96, 48, 32))]

    def loss(jobs, norms):
        outs = [o for pair in norms(jobs) for o in pair if o is not None]
        return sum(jnp.sum(o * p) for o, p in zip(outs, probes, strict=True))

    want = jax.grad(loss)(jobs, lambda js: tuple(add_rms_norm(*j, 1e-6) for j in js))
    got = jax.grad(loss)(jobs, lambda js: fused_rms_norms(js, 1e-6, True))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_decoder_with_the_kernel_matches_plain():
    """A tiny target's verify step (all its norms through the kernel, interpret mode) against the plain norms."""
    spec, weights = tiny_pair(seed=3)
    cfg, w = spec.target, weights.target
    tokens_BT = jnp.asarray([[5, 9, 11], [7, 2, 30]])
    positions_BT = jnp.asarray([[0, 1, 2], [4, 5, 6]])
    cache = init_latent_cache(cfg, 2, 64, jnp.float32)
    outs = {}
    for norm in ("on", "off"):
        c = cfg.replace(kernels=Kernels(norm=norm, moe="off", mla="off", router="off"))
        outs[norm] = jax.jit(lambda w, t, p, cache, c=c: forward(w, c, t, p, cache))(w, tokens_BT, positions_BT,
                                                                                      cache)
    np.testing.assert_allclose(np.asarray(outs["on"].logits), np.asarray(outs["off"].logits), rtol=1e-5, atol=1e-5)
    for a, b in zip(outs["on"].cache.latent, outs["off"].cache.latent, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_dispatch():
    """"auto" takes the kernel on one GPU for decode and verify rows only; "off" never, "on" always."""
    assert not norm_kernel_applies(Kernels(), 1)  # these tests run on a CPU
    assert not norm_kernel_applies(Kernels(norm="off"), 1)
    assert norm_kernel_applies(Kernels(norm="on"), NORM_KERNEL_MAX_ROWS + 1)
    with pytest.raises(ConfigError, match="kernels.norm"):
        Kernels(norm="fused")


def test_lowers_to_triton_at_k25_shapes():
    """The decoder's three launches per layer at 4 rows: input norm, q_a + kv_a norms, residual add + norm."""
    from tests.test_kernels_moe import _pretend_h200

    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def layer_norms(x, attn, w_h, q_a, w_q, kv, w_c):
        return fused_rms_norms((NormJob(x, None, w_h),), 1e-6), \
            fused_rms_norms((NormJob(kv, None, w_c), NormJob(q_a, None, w_q)), 1e-6), \
            fused_rms_norms((NormJob(x, attn, w_h),), 1e-6)

    restore = _pretend_h200()
    try:
        lowered = jax.jit(layer_norms).trace(
            sds((4, 7168), bf), sds((4, 7168), bf), sds((7168,), bf), sds((4, 1536), bf), sds((1536,), bf),
            sds((4, 576), bf), sds((512,), bf)).lower(lowering_platforms=("cuda",))
    finally:
        restore()
    assert lowered.as_text().count("rms_norm_rows") >= 3
