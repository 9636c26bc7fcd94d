"""model.kernels.moe_grouped (routed experts that convert an expert several slots chose once) against the plain
reference, in Pallas' GPU interpreter on CPU, and lowered to Mosaic GPU at Kimi K2 shapes (Mosaic's layout and
lowering checks); its bookkeeping against a plain count."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels import moe_grouped
from model.moe import ExpertWeights, experts_gather
from model.quant import Int4Weight
from tests.test_kernels_moe_wgmma import H, _rel_err, experts  # noqa: F401  (the module's fixture)


def test_shared_groups_hold_the_experts_several_slots_chose():
    ids = jnp.asarray([[3, 1], [1, 4], [3, 5]], jnp.int32)
    w = jnp.asarray([[0.5, 0.25], [0.75, 1.0], [0.125, 0.5]], jnp.float32)
    g = moe_grouped.shared_groups(ids, w, min_members=2)
    assert g.shared_P.tolist() == [True, True, True, False, True, False]
    assert g.expert_U.tolist() == [3, 1, -1]  # in order of first choice; the rest exit
    np.testing.assert_array_equal(g.member_UT, [[True, False, True], [True, True, False], [False] * 3])
    np.testing.assert_allclose(g.weight_UT, [[0.5, 0.0, 0.125], [0.25, 0.75, 0.0], [0.0] * 3])


@pytest.mark.parametrize("m", [2, 3])
def test_shared_groups_match_a_plain_count_at_random_routings(m):
    rng = np.random.default_rng(m)
    # jitted: one program a shape, where running op by op compiles every operation on its own
    shared_groups = jax.jit(moe_grouped.shared_groups, static_argnames="min_members")
    for t, k in ((1, 8), (3, 4), (4, 8), (8, 2)):  # each shape compiles its own program: few shapes, several draws
        for e in (k, 2 * k, 3 * k):
            ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
            # a quarter of the slots inactive (weight 0: another device's expert under expert parallelism)
            w = np.where(rng.uniform(size=(t, k)) < 0.25, 0.0, rng.uniform(0.1, 1.0, (t, k))).astype(np.float32)
            g = shared_groups(jnp.asarray(ids), jnp.asarray(w), min_members=m)
            flat = np.where(w.reshape(-1) != 0, ids.reshape(-1), -1)  # -1: joins no group
            order = list(dict.fromkeys(x for x in flat if x >= 0 and (flat == x).sum() >= m))  # first choice first
            want_expert = np.full(max(1, t * k // m), -1)
            want_expert[:len(order)] = order
            np.testing.assert_array_equal(g.expert_U, want_expert)
            for u, x in enumerate(order):
                np.testing.assert_allclose(g.weight_UT[u], np.where(ids == x, w, 0.0).sum(axis=1), rtol=1e-6)
                np.testing.assert_array_equal(g.member_UT[u], ((ids == x) & (w != 0)).any(axis=1))
            np.testing.assert_array_equal(g.shared_P, [x >= 0 and (flat == x).sum() >= m for x in flat])


def test_shared_groups_refuse_one_member_groups():
    with pytest.raises(ValueError, match="min_members=1"):
        moe_grouped.shared_groups(jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2)), min_members=1)


@pytest.mark.parametrize("t,share", [(2, "some")])
def test_interpret_matches_reference(experts, t, share):  # noqa: F811
    k = 4
    rng = np.random.default_rng(t)
    if share == "all":  # every token the same experts: only the group kernels work
        ids = np.tile(rng.permutation(6)[:k], (t, 1))
    else:  # token 1 shares two experts with token 0: both kernels work
        ids = np.stack([rng.permutation(6)[:k] for _ in range(t)])
        ids[1, :2] = ids[0, :2]
        ids[1] = np.concatenate([ids[1, :2], [e for e in range(6) if e not in ids[1, :2]][:k - 2]])
    ids = jnp.asarray(ids, jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(t), (t, H)).astype(jnp.bfloat16)
    # two members make a group here, so both kernels work on two tokens (one interpreter run: the suite's time)
    fn = jax.jit(functools.partial(moe_grouped.routed_experts_grouped, down_splits=2, min_members=2, interpret=True))
    out = fn(x, experts, ids, w)
    ref = experts_gather(x.astype(jnp.float32), experts, ids, w)
    assert out.shape == (t, H)
    assert _rel_err(out, ref) < 1e-2


def test_lowers_to_mosaic_gpu_at_kimi_shapes():
    e, f, h, t = 384, 2048, 7168, 4
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((e, o, i // 8), jnp.uint32), sd((e, o, i // 32), jnp.bfloat16))  # noqa: E731
    experts = ExpertWeights(w(f, h), w(f, h), w(h, f))
    fn = functools.partial(moe_grouped.routed_experts_grouped, gate_up_splits=7, down_splits=8)
    lowered = jax.jit(fn).trace(sd((t, h), jnp.bfloat16), experts, sd((t, 8), jnp.int32),
                                sd((t, 8), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 4  # the slot kernels and the group kernels


def test_grouped_config_takes_it_for_verify_only(experts):  # noqa: F811
    from model.config import Kernels
    from model.kernels import dispatch
    from model.kernels.target import compiling_for

    grouped = Kernels(moe="grouped")
    with compiling_for("gpu", "9.0"):
        assert [dispatch.moe_kernel_for(t, experts, grouped) for t in (1, 2, 8, 9)] == ["wgmma", "grouped", "grouped",
                                                                                           "wgmma"]
        assert dispatch.moe_kernel_for(4, experts, Kernels()) == "wgmma"  # the default keeps the slot kernel
