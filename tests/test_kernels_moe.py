"""The fused Pallas MoE (model/kernels) against the plain reference `experts_gather`, in interpret mode on CPU.

The GPU run of the same kernel is checked against the reference by bench/moe_layer.py (its result is in
bench/results/). Here we also lower the kernel to Triton IR at Kimi K2 shapes, which catches
unsupported operations without a GPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels.dispatch import MAX_KERNEL_TOKENS, triton_config_for
from model.kernels.moe_tiles import expert_slots
from model.kernels.int4_tile import nibble_float, nibble_offset, repeat_last, shifted_words
from model.kernels.moe_gather import routed_experts_pallas
from model.kernels.moe_tiles import MoEKernelConfig
from model.moe import ExpertWeights, experts_gather, routed_experts
from model.quant import Int4Weight, dequantize, unpack_int4

E, F, H, K = 6, 128, 128, 3  # H of 128, not 256: interpret mode runs each grid block op by op
TINY = MoEKernelConfig(block_f=16, block_h=16, block_k=16)
TINY_GEMV = MoEKernelConfig(block_f=16, block_h=16, block_k=16, variant="gemv")
# jitted: interpret mode run op by op is far slower than one compiled loop over the grid
interpret_kernel = jax.jit(functools.partial(routed_experts_pallas, cfg=TINY, interpret=True))
interpret_gemv = jax.jit(functools.partial(routed_experts_pallas, cfg=TINY_GEMV, interpret=True))


def _int4(key, out, inp):
    kb, ks = jax.random.split(key)
    packed = jax.random.bits(kb, (E, out, inp // 8), jnp.uint32)
    scale = (0.01 + 0.05 * jax.random.uniform(ks, (E, out, inp // 32))).astype(jnp.bfloat16)
    return Int4Weight(packed, scale)


@pytest.fixture(scope="module")
def int4_experts():
    kg, ku, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    return ExpertWeights(_int4(kg, F, H), _int4(ku, F, H), _int4(kd, H, F))


def _routing(t, seed):
    """Distinct experts per token; tokens overlap (so slots must merge them)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(t, K)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(weights)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def test_nibble_floats_are_exact():
    words = jax.random.bits(jax.random.PRNGKey(2), (4, 16), jnp.uint32)
    q = np.asarray(unpack_int4(words)).reshape(4, 16, 8)
    shifted = shifted_words(words)
    for j in range(8):
        expected = q[:, :, j].astype(np.float32) + nibble_offset(j)
        np.testing.assert_array_equal(np.asarray(nibble_float(shifted, j)), expected)


def test_repeat_last_is_repeat():
    x = jnp.arange(24.0).reshape(3, 8)
    np.testing.assert_array_equal(np.asarray(repeat_last(x, 4)), np.repeat(np.asarray(x), 4, axis=-1))


def test_expert_slots_merge_shared_experts():
    ids = jnp.asarray([[4, 1, 2], [2, 4, 0]], jnp.int32)
    w = jnp.asarray([[0.5, 0.25, 0.125], [1.0, 2.0, 4.0]], jnp.float32)
    s = expert_slots(ids, w, num_slots=6, tokens_padded=4)
    assert int(s.num_used[0]) == 4
    np.testing.assert_array_equal(np.asarray(s.expert_U[:4]), [0, 1, 2, 4])
    expected = np.zeros((6, 4), np.float32)
    expected[[0, 1, 2, 3], 0] = [0.0, 0.25, 0.125, 0.5]
    expected[[0, 1, 2, 3], 1] = [4.0, 0.0, 1.0, 2.0]
    np.testing.assert_array_equal(np.asarray(s.combine_UT), expected)


def test_int4_kernel_is_exact_in_float32(int4_experts):
    """float32 activations: the same arithmetic as the reference up to summation order (3 tokens sharing experts)."""
    ids, w = _routing(3, seed=3)
    x = jax.random.normal(jax.random.PRNGKey(3), (3, H), jnp.float32)
    assert _rel_err(interpret_kernel(x, int4_experts, ids, w), experts_gather(x, int4_experts, ids, w)) < 1e-5


def test_bf16_kernel_matches_reference(int4_experts):
    """bf16 weights and activations (what runs): within bf16 rounding of the reference."""
    experts = ExpertWeights(*(dequantize(m, jnp.bfloat16) for m in (int4_experts.gate, int4_experts.up, int4_experts.down)))
    ids, w = _routing(2, seed=7)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, H), jnp.float32).astype(jnp.bfloat16)
    out = interpret_kernel(x, experts, ids, w)
    assert _rel_err(out, experts_gather(x, experts, ids, w)) < 2e-2


def test_gemv_variant_matches_reference(int4_experts):
    """The CUDA-core variant (1-4 tokens): INT4 exact in float32, and its bf16-weight path within rounding."""
    ids, w = _routing(3, seed=11)
    x = jax.random.normal(jax.random.PRNGKey(5), (3, H), jnp.float32)
    # The gemv multiplies the nibbles as 256 + n / 16 + n and takes 264 / 24 times the sum of x back out per word:
    # that cancellation costs ~5 of float32's 24 bits (1.05e-5 here with the tests' -O0 CPU code, which fuses no
    # multiply-add; the GPU's PTX fma rounds once)
    assert _rel_err(interpret_gemv(x, int4_experts, ids, w), experts_gather(x, int4_experts, ids, w)) < 3e-5
    experts = ExpertWeights(*(dequantize(m, jnp.bfloat16) for m in (int4_experts.gate, int4_experts.up, int4_experts.down)))
    xb = x[:2].astype(jnp.bfloat16)
    out = interpret_gemv(xb, experts, ids[:2], w[:2])
    assert out.dtype == jnp.bfloat16
    assert _rel_err(out, experts_gather(xb, experts, ids[:2], w[:2])) < 2e-2
    pairs = jax.jit(functools.partial(routed_experts_pallas, cfg=MoEKernelConfig(
        block_f=16, block_h=16, block_k=16, variant="gemv", slots="pairs", down_splits=2),
        interpret=True))
    xb4 = jax.random.normal(jax.random.PRNGKey(7), (4, H), jnp.float32).astype(jnp.bfloat16)
    ids4, w4 = _routing(4, seed=12)
    assert _rel_err(pairs(xb4, experts, ids4, w4), experts_gather(xb4, experts, ids4, w4)) < 2e-2


def test_pair_slots_need_the_gemv_variant(int4_experts):
    ids, w = _routing(2, seed=9)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, H), jnp.float32)
    with pytest.raises(ValueError, match="slots='pairs' needs variant='gemv'"):
        routed_experts_pallas(x, int4_experts, ids, w, cfg=MoEKernelConfig(slots="pairs"), interpret=True)


@pytest.mark.parametrize("variant, scales, prefetch, down_splits, slots", [
    ("mma", "join", False, 1, "unique"), ("mma", "gather", False, 5, "unique"),
    ("gemv", "join", False, 1, "unique"), ("gemv", "gather", True, 5, "unique"),
    ("gemv", "gather", False, 2, "pairs"), ("gemv", "join", True, 3, "pairs"),
])
def test_kernel_options_keep_the_result(int4_experts, variant, scales, prefetch, down_splits, slots):
    """Scale loading, prefetch, split down loops and slot kinds change the schedule only; 5 splits of 6 slots
    leaves the last split empty and makes the prefetch look one slot past the end; pairs with 2 splits of K=3
    choices give splits of 2 and 1, and the routing repeats experts across tokens (read once per pair)."""
    cfg = MoEKernelConfig(block_f=16, block_h=16, block_k=16, variant=variant, scales=scales, prefetch=prefetch,
                          down_splits=down_splits, slots=slots)
    kernel = jax.jit(functools.partial(routed_experts_pallas, cfg=cfg, interpret=True))
    ids, w = _routing(3, seed=13)
    x = jax.random.normal(jax.random.PRNGKey(6), (3, H), jnp.float32)
    assert _rel_err(kernel(x, int4_experts, ids, w), experts_gather(x, int4_experts, ids, w)) < 1e-5


def test_backend_dispatch_is_reference_on_cpu(int4_experts):
    """Off the GPU no kernel config selects a kernel: `routed_experts` is the plain reference path."""
    from model.config import Kernels
    from model.kernels.dispatch import moe_kernel_for
    from model.moe import plain_routed_experts

    ids, w = _routing(2, seed=9)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, H), jnp.float32)
    for kernels in (Kernels(), Kernels(moe="wgmma"), Kernels(moe="triton"), Kernels(moe="off")):
        assert moe_kernel_for(2, int4_experts, kernels) is None
        np.testing.assert_array_equal(np.asarray(routed_experts(x, int4_experts, ids, w, kernels)),
                                      np.asarray(plain_routed_experts(x, int4_experts, ids, w)))


def _pretend_h200():
    """jax >= 0.11 asks the local device for its compute capability when lowering for CUDA."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return lambda: None
    saved = gpu_info.get_gpu_info
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)

    def restore():
        gpu_info.get_gpu_info = saved

    return restore


@pytest.mark.parametrize("variant", ["mma", "gemv", "engine"])  # engine: what triton_config_for dispatches at T=4
@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_lowers_to_triton_at_kimi_shapes(fmt, variant):
    e, f, h, k, t = 384, 2048, 7168, 8, 4
    sds = jax.ShapeDtypeStruct
    if fmt == "int4":
        mat = lambda o, i: Int4Weight(sds((e, o, i // 8), jnp.uint32), sds((e, o, i // 32), jnp.bfloat16))  # noqa: E731
    else:
        mat = lambda o, i: sds((e, o, i), jnp.bfloat16)  # noqa: E731
    experts = ExpertWeights(mat(f, h), mat(f, h), mat(h, f))
    restore = _pretend_h200()
    try:
        cfg = triton_config_for(t, experts) if variant == "engine" else MoEKernelConfig(
            block_k=64 if fmt == "int4" else 256, variant=variant, prefetch=variant == "gemv", down_splits=4)
        lowered = jax.jit(functools.partial(routed_experts_pallas, cfg=cfg)).trace(
            sds((t, h), jnp.bfloat16), experts, sds((t, k), jnp.int32), sds((t, k), jnp.float32)
        ).lower(lowering_platforms=("cuda",))
    finally:
        restore()
    text = lowered.as_text()
    assert text.count("triton") >= 2
    if fmt == "int4":  # the single-instruction dequantization and FMAs made it into the Triton IR
        assert "lop3.b32" in text and "fma.rn.f32" in text


@pytest.mark.parametrize("tokens", [1, 16, 64, 65, 100, 128])
def test_int4_prefill_buckets_take_the_pairs_kernel(tokens):
    """Up to MAX_KERNEL_TOKENS (the 128-token prefill bucket) INT4 experts run the one-slot-per-pair kernel: the
    mma tiles need more shared memory than Hopper has at 128 tokens, and were slower at 64."""
    sds = jax.ShapeDtypeStruct
    mat = lambda o, i: Int4Weight(sds((384, o, i // 8), jnp.uint32), sds((384, o, i // 32), jnp.bfloat16))  # noqa: E731
    experts = ExpertWeights(mat(2048, 7168), mat(2048, 7168), mat(7168, 2048))
    assert tokens <= MAX_KERNEL_TOKENS
    cfg = triton_config_for(tokens, experts)
    assert (cfg.variant, cfg.slots) == ("gemv", "pairs")
