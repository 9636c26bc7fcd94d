"""The Mosaic GPU MoE (model/kernels/moe_wgmma.py) against the plain reference `experts_gather`.

On CPU the kernels run under Pallas' GPU interpreter (the same pipelines, index maps, splits and column
order; a dot_general stands in for the register-operand wgmma and its int4 conversion, which the interpreter
lacks). The same kernels are also lowered to Mosaic GPU at Kimi K2 shapes, which runs Mosaic's layout and
lowering checks without a GPU. On the GPU, bench/moe_layer.py and bench/kernel_agreement.py hold it to the
reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import Kernels
from model.kernels import moe_wgmma
from model.kernels.dispatch import moe_kernel_for, wgmma_config_for
from model.moe import ExpertWeights, experts_gather
from model.moe_parallel import local_choices
from model.quant import Int4Weight, dequantize

E, F, H, K = 6, 256, 512, 4


def _int4(key, e, out, inp, group=32):
    kb, ks = jax.random.split(key)
    packed = jax.random.bits(kb, (e, out, inp // 8), jnp.uint32)
    scale = (0.01 + 0.05 * jax.random.uniform(ks, (e, out, inp // group))).astype(jnp.bfloat16)
    return Int4Weight(packed, scale)


@pytest.fixture(scope="module")
def experts():
    kg, ku, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    return ExpertWeights(_int4(kg, E, F, H), _int4(ku, E, F, H), _int4(kd, E, H, F))


def _routing(t, seed):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1.0, size=(t, K)).astype(np.float32))


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# several tokens with both kernels split (gate_up and down in 2) are held to the reference by
# test_zero_weight_slots_are_skipped_and_add_nothing, beside its inactive slots
@pytest.mark.parametrize("t,gate_up_splits,down_splits,down_k_splits", [(1, 1, 4, 1), (1, 2, 1, 1)])
def test_interpret_matches_reference(experts, t, gate_up_splits, down_splits, down_k_splits):
    x = jax.random.normal(jax.random.PRNGKey(t), (t, H)).astype(jnp.bfloat16)
    ids, w = _routing(t, t)
    fn = jax.jit(functools.partial(moe_wgmma.routed_experts_wgmma, gate_up_splits=gate_up_splits,
                                   down_splits=down_splits, down_k_splits=down_k_splits, interpret=True))
    out = fn(x, experts, ids, w)
    ref = experts_gather(x.astype(jnp.float32), experts, ids, w)
    assert out.shape == (t, H) and out.dtype == jnp.bfloat16
    # x and h enter the wgmma as bf16 (the Triton kernels keep h in f32): ~3e-3 of rounding
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("down_splits", [2])
def test_zero_weight_slots_are_skipped_and_add_nothing(experts, down_splits):
    """Slots of router weight 0 (under expert parallelism: every choice of another device's expert, pointed at a
    local one) are skipped by both kernels; their unwritten rows are masked, so the result is the reference's.
    Token 1 has no active choice at all, token 0 a whole down split without one (its choices 0 and 1), token 2 a
    split with one inactive choice among active ones (run, its h zero). gate_up split in 2 as well: three tokens
    through both kernels split are also the reference's several-token check."""
    t = 3
    x = jax.random.normal(jax.random.PRNGKey(11), (t, H)).astype(jnp.bfloat16)
    ids, w = _routing(t, 11)
    w = w.at[0, :2].set(0.0).at[1, :].set(0.0).at[2, 3].set(0.0)
    fn = jax.jit(functools.partial(moe_wgmma.routed_experts_wgmma, gate_up_splits=2, down_splits=down_splits,
                                   interpret=True))
    out = fn(x, experts, ids, w)
    ref = experts_gather(x.astype(jnp.float32), experts, ids, w)
    assert np.all(np.asarray(out[1], np.float32) == 0.0)
    assert _rel_err(out, ref) < 1e-2
    # the skipped slots' rows are left as the buffer held them: only the masks make them add nothing
    gu = moe_wgmma.gate_up_sums(x, experts.gate, experts.up, ids.reshape(-1), choices=K,
                                weight_U=w.reshape(-1), interpret=True)
    h = moe_wgmma.swiglu_h(gu, w)
    assert np.all(np.asarray(h)[np.asarray(w.reshape(-1)) == 0] == 0.0)
    written = np.asarray(moe_wgmma.split_active_ZT(w, down_splits, 1))
    assert written.shape == (down_splits, t) and not written[:, 1].any()


@pytest.mark.parametrize("first", [0, 6, 18])
def test_global_choices_keep_to_the_devices_experts(experts, first):
    """With `first_expert` the kernels take the router's global ids over 24 experts and hold experts [first, first
    + 6): each token's sum over the choices of those experts, as the reference gives it with the choices restricted
    to them (`local_choices`); a token with none of them gets zeros."""
    t, e_global = 3, 4 * E
    rng = np.random.default_rng(first)
    ids = np.stack([rng.permutation(e_global)[:K] for _ in range(t)]).astype(np.int32)
    ids[0, 0], ids[1] = first + 1, [(first + E + j) % e_global for j in range(K)]  # token 1: none of this device's
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(t, K)).astype(np.float32))
    ids = jnp.asarray(ids)
    x = jax.random.normal(jax.random.PRNGKey(first), (t, H)).astype(jnp.bfloat16)
    fn = jax.jit(functools.partial(moe_wgmma.routed_experts_wgmma, gate_up_splits=2, down_splits=2, interpret=True))
    out = fn(x, experts, ids, w, first_expert=jnp.int32(first))
    ref = experts_gather(x.astype(jnp.float32), experts, *local_choices(ids, w, first, E))
    assert np.all(np.asarray(out[1], np.float32) == 0.0)
    assert _rel_err(out, ref) < 1e-2


def test_gate_up_sums_are_the_two_products(experts):
    """The first kernel alone: gate / up rows of each slot's expert, summed over the splits of H (two slots share
    expert 0), in the down kernel's column order (`permute_K`)."""
    x = jax.random.normal(jax.random.PRNGKey(5), (2, H)).astype(jnp.bfloat16)
    expert_U, token_U = jnp.asarray([4, 0, 0, 5], jnp.int32), jnp.asarray([0, 0, 1, 1], jnp.int32)
    gu = moe_wgmma.gate_up_sums(x, experts.gate, experts.up, expert_U, choices=2, splits=2, interpret=True)
    assert gu.shape == (2, 2, 4, F)
    xs = x.astype(jnp.float32)[token_U]
    for m, weight in enumerate((experts.gate, experts.up)):
        dense = dequantize(weight, jnp.float32)[expert_U]
        np.testing.assert_allclose(np.asarray(gu[:, m].sum(0)),
                                   moe_wgmma.permute_K(np.einsum("uh,ufh->uf", xs, dense)),
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("splits,k_splits", [(1, 2), (2, 2)])
def test_down_sums_split_over_choices_and_F(splits, k_splits):
    """The second kernel alone: row s * k_splits + ks holds token t's down(h) over split s of its choices and share
    ks of F; all rows together are the token's whole sum. h comes in the kernel's column order (`permute_K`)."""
    e, f, h, choices = 3, 512, 256, 2
    down = _int4(jax.random.PRNGKey(8), e, h, f)
    h_UF = jax.random.normal(jax.random.PRNGKey(9), (2 * choices, f)).astype(jnp.bfloat16)
    expert_U = jnp.asarray([2, 0, 0, 1], jnp.int32)
    y = moe_wgmma.down_sums(moe_wgmma.permute_K(h_UF), down, expert_U, choices=choices, splits=splits,
                            k_splits=k_splits, interpret=True)
    assert y.shape == (splits * k_splits, 2, h)
    dense = dequantize(down, jnp.float32)[expert_U]  # [U, H, F]
    per_slot = np.einsum("uf,uhf->uh", np.asarray(h_UF, np.float32), np.asarray(dense))
    share = f // k_splits
    for s in range(splits):
        for ks in range(k_splits):
            want = np.einsum("uf,uhf->uh", np.asarray(h_UF, np.float32)[:, ks * share:(ks + 1) * share],
                             np.asarray(dense)[:, :, ks * share:(ks + 1) * share]).reshape(2, choices, h)
            np.testing.assert_allclose(np.asarray(y[s * k_splits + ks]),
                                       want[:, s * choices // splits:(s + 1) * choices // splits].sum(1),
                                       rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(y.sum(0)), per_slot.reshape(2, choices, h).sum(1), rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="down_k_splits=3"):
        moe_wgmma.down_sums(h_UF, down, expert_U, choices=choices, k_splits=3, interpret=True)


def test_column_order_is_a_permutation_within_groups():
    v = jnp.arange(2 * 256).reshape(2, 256)
    p = np.asarray(moe_wgmma.permute_K(v))
    assert sorted(p[1].tolist()) == list(range(256, 512))
    assert (p // 32 == np.arange(256)[None] // 32 + np.array([[0], [8]])).all()  # each value stays in its group
    # wgmma column 32c + 8p + 2j + e holds original column 32c + 8j + p + 4e
    for c, pp, j, e in [(0, 0, 0, 1), (3, 2, 1, 0), (7, 3, 3, 1)]:
        assert p[0, 32 * c + 8 * pp + 2 * j + e] == 32 * c + 8 * j + pp + 4 * e
    a, b = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 256))
    np.testing.assert_allclose(moe_wgmma.permute_K(a) @ moe_wgmma.permute_K(b).T, a @ b.T, rtol=1e-5)


def test_block_diagonal_puts_each_group_in_its_row():
    v = (jnp.arange(512, dtype=jnp.float32) % 250 + 1).reshape(1, 512)  # nonzero integers, exact in bf16
    bd = np.asarray(moe_wgmma.block_diagonal_UNGK(v), np.float32)[0]
    assert bd.shape == (2, moe_wgmma.GROUPS, 256)  # tiles, groups, columns of a tile
    np.testing.assert_array_equal(bd.sum(1).reshape(512), np.asarray(v[0]))  # every value once, in its tile
    for k in (0, 31, 32, 255, 256, 300, 511):
        assert bd[k // 256, (k % 256) // 32, k % 256] == v[0, k]


def test_int4_nibbles_are_q_plus_8(experts):
    q = np.asarray(moe_wgmma.int4_nibbles(experts.gate).astype(jnp.int32))
    flipped = np.where(q < 0, q + 16, q) - 8  # the nibble read as unsigned, minus the stored bias
    dense = np.asarray(dequantize(Int4Weight(experts.gate.packed, jnp.ones_like(experts.gate.scale)), jnp.float32))
    np.testing.assert_array_equal(flipped, dense)


def test_unsupported_shapes_are_refused(experts):
    mats = (experts.gate, experts.up, experts.down)
    bf16 = ExpertWeights(*(dequantize(m, jnp.bfloat16) for m in mats))
    group64 = ExpertWeights(*(Int4Weight(m.packed, m.scale[..., ::2]) for m in mats))
    f32_scales = ExpertWeights(*(Int4Weight(m.packed, m.scale.astype(jnp.float32)) for m in mats))
    x = jnp.zeros((1, H), jnp.bfloat16)
    ids, w = _routing(1, 0)

    def trace(experts, **options):  # refused while tracing: nothing runs (the down split is checked after gate_up)
        fn = functools.partial(moe_wgmma.routed_experts_wgmma, interpret=True, **options)
        return jax.eval_shape(fn, x, experts, ids, w)

    for bad in (bf16, group64, f32_scales):
        assert not moe_wgmma.supports(bad)
        with pytest.raises(ValueError, match="group size 32"):
            trace(bad)
    with pytest.raises(ValueError, match="down_splits=3"):
        trace(experts, down_splits=3)
    with pytest.raises(ValueError, match="gate_up_splits=3"):
        trace(experts, gate_up_splits=3)
    assert trace(experts).shape == (1, H)  # the same call with valid splits traces


def test_engine_picks_it_only_on_hopper(experts):
    assert moe_kernel_for(1, experts) is None  # CPU: the plain path, whatever the kernel config names
    assert moe_kernel_for(1, experts, Kernels(moe="wgmma")) is None
    cfg = wgmma_config_for(experts, K)
    assert cfg["down_splits"] == 4 and cfg["gate_up_splits"] == 2  # H / 256 = 2 tiles


def test_gate_up_splits_follow_the_token_count():
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((384, o, i // 8), jnp.uint32), sd((384, o, i // 32), jnp.bfloat16))  # noqa: E731
    k2 = ExpertWeights(w(2048, 7168), w(2048, 7168), w(7168, 2048))  # 28 tiles of H
    assert [wgmma_config_for(k2, 8, t)["gate_up_splits"] for t in (1, 4, 8, 9, 16, 64)] == [7, 7, 7, 4, 4, 4]
    assert wgmma_config_for(k2, 8, 1)["down_splits"] == 8
    assert [wgmma_config_for(k2, 8, t)["down_k_splits"] for t in (1, 2, 4)] == [2, 1, 1]


@pytest.mark.parametrize("t,options", [(1, {}), (4, {}), (32, {}), (1, {"gate_up_splits": 7, "down_k_splits": 2}),
                                       (1, {"first_expert": 48}), (4, {"first_expert": 48})])
def test_lowers_to_mosaic_gpu_at_kimi_shapes(t, options):
    e, f, h = 384, 2048, 7168
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((e, o, i // 8), jnp.uint32), sd((e, o, i // 32), jnp.bfloat16))  # noqa: E731
    experts = ExpertWeights(w(f, h), w(f, h), w(h, f))
    fn = functools.partial(moe_wgmma.routed_experts_wgmma, **{**wgmma_config_for(experts, 8, t), **options})
    lowered = jax.jit(fn).trace(sd((t, h), jnp.bfloat16), experts, sd((t, 8), jnp.int32),
                                sd((t, 8), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 2  # both kernels became Mosaic GPU custom calls
