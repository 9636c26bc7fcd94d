"""The expert-grouped Mosaic GPU MoE (model/kernels/moe_wgmma_grouped.py) against the plain reference.

On CPU its kernels run under Pallas' GPU interpreter (the same grids, index maps, skipped groups and both paths:
one member token through moe_wgmma's block-diagonal tiles, several through the token tiles); they are also
lowered to Mosaic GPU at Kimi K2 shapes. bench/moe_wgmma_lab.py (`g:STAGES:SPLITS`, `--routing`) holds the GPU
result to the reference and times it (bench/results/README.md, run 17)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.kernels import moe_wgmma_grouped as grouped
from model.moe import ExpertWeights, experts_gather
from model.quant import Int4Weight
from tests.test_kernels_moe_wgmma import E, H, K, experts  # noqa: F401  (the same small INT4 experts: a fixture)


def test_expert_groups_collects_each_experts_tokens():
    ids = jnp.asarray([[4, 0, 2], [0, 5, 2]], jnp.int32)
    w = jnp.asarray([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], jnp.float32)
    expert_G, weight_GT, member_GT = grouped.expert_groups(ids, w)
    assert expert_G.tolist() == [0, 2, 4, 5, -1, -1]  # sorted distinct experts, the unused groups -1
    np.testing.assert_allclose(np.asarray(weight_GT)[:4], [[0.2, 0.4], [0.3, 0.6], [0.1, 0.0], [0.0, 0.5]])
    assert np.asarray(member_GT).tolist()[:4] == [[True, True], [True, True], [True, False], [False, True]]
    assert not np.asarray(member_GT)[4:].any() and not np.asarray(weight_GT)[4:].any()


def test_token_tiles_put_each_groups_columns_per_token():
    v = jnp.arange(2 * 3 * 512, dtype=jnp.float32).reshape(2, 3, 512) % 200
    tiles = np.asarray(grouped.token_tiles(v, convert="mosaic"), np.float32)  # "mosaic": columns in order
    assert tiles.shape == (2, 2, 8, 8, 32)  # X, tiles of K, scale groups, 8 token rows, 32 columns
    np.testing.assert_array_equal(tiles[1, 1, 3, 2], np.asarray(v)[1, 2, 256 + 96:256 + 128])
    assert not tiles[:, :, :, 3:].any()  # tokens 3..7 are padding


@pytest.mark.parametrize("t,routing,splits,paths", [(3, "random", 2, "both"), (4, "shared", 1, "both"),
                                                    (1, "random", 1, "both"), (3, "random", 1, "tokens"),
                                                    (3, "random", 2, "split")])
def test_interpret_matches_reference(experts, t, routing, splits, paths):
    rng = np.random.default_rng(t)
    if routing == "shared":  # every token the same experts: groups of t members only
        ids = np.tile(rng.permutation(E)[:K], (t, 1))
    else:  # some groups of one member, some of several
        ids = np.stack([rng.permutation(E)[:K] for _ in range(t)])
    ids = jnp.asarray(ids.astype(np.int32))
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(t, K)).astype(np.float32))
    x = jax.random.normal(jax.random.PRNGKey(t), (t, H)).astype(jnp.bfloat16)
    fn = jax.jit(functools.partial(grouped.routed_experts_grouped, gate_up_splits=splits,
                                   paths=paths, interpret=True))
    out = fn(x, experts, ids, w)
    ref = experts_gather(x.astype(jnp.float32), experts, ids, w)
    assert out.shape == (t, H) and out.dtype == jnp.bfloat16
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(o).all() and np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2


def test_bad_arguments_are_refused(experts):
    x = jnp.zeros((9, H), jnp.bfloat16)
    ids, w = jnp.zeros((9, K), jnp.int32), jnp.ones((9, K), jnp.float32)
    with pytest.raises(ValueError, match="up to 8 tokens, got 9"):
        grouped.routed_experts_grouped(x, experts, ids, w, interpret=True)
    with pytest.raises(ValueError, match="gate_up_splits=3"):
        grouped.routed_experts_grouped(x[:2], experts, ids[:2], w[:2], gate_up_splits=3, interpret=True)
    with pytest.raises(ValueError, match="paths must be one of"):
        grouped.routed_experts_grouped(x[:2], experts, ids[:2], w[:2], paths="one", interpret=True)
    bf16 = ExpertWeights(*(jnp.zeros(m.packed.shape[:-1] + (m.packed.shape[-1] * 8,), jnp.bfloat16)
                           for m in (experts.gate, experts.up, experts.down)))
    with pytest.raises(ValueError, match="INT4 experts"):
        grouped.routed_experts_grouped(x[:2], bf16, ids[:2], w[:2], interpret=True)


@pytest.mark.parametrize("t,paths", [(2, "both"), (8, "both"), (4, "split")])
def test_lowers_to_mosaic_gpu_at_kimi_shapes(t, paths):
    e, f, h = 384, 2048, 7168
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((e, o, i // 8), jnp.uint32), sd((e, o, i // 32), jnp.bfloat16))  # noqa: E731
    experts = ExpertWeights(w(f, h), w(f, h), w(h, f))
    fn = functools.partial(grouped.routed_experts_grouped, gate_up_splits=4, paths=paths)
    lowered = jax.jit(fn).trace(sd((t, h), jnp.bfloat16), experts, sd((t, 8), jnp.int32),
                                sd((t, 8), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= (4 if paths == "split" else 2)  # a kernel per path, per stage


def test_lab_names_its_variants():
    from bench.moe_wgmma_lab import _candidate, _candidate_on_experts

    name, fn = _candidate_on_experts("g:2:4")
    assert name == "grouped_2:4" and fn.keywords == dict(stages=2, gate_up_splits=4, paths="both")
    assert _candidate("g:2:4")[0] == name  # the lab's candidates take (experts, fused down layout) as one argument
    assert _candidate_on_experts("g:3:2:t")[1].keywords["paths"] == "tokens"
    assert _candidate_on_experts("g:2:4:s")[1].keywords["paths"] == "split"
    assert _candidate("2:4:8:0:p:b")[0] == "wgmma_2:4:8:0:p:b"
    assert _candidate_on_experts("2:4:8:0:p:b")[1].keywords["down_k_splits"] == 1
    assert _candidate_on_experts("2:7:8:2:p:b")[1].keywords["overlap"] == 2
    name, fn = _candidate("f:4:4:1:2:0")
    assert name == "fused_f:4:4:1:2:0" and fn.keywords == dict(stages=4, down_stages=4, overlap=1, down_tiles=2,
                                                                biased=0)
    assert _candidate("f")[1].keywords == {}
    assert _candidate_on_experts("2:7:8:0:p:b:2:o:2")[1].keywords == dict(
        stages=2, gate_up_splits=7, down_splits=8, overlap=False, convert="pairs", permute_h="before", down_stages=2,
        slots_inner=False, down_k_splits=2, halves=0, choice_groups=1, down_row_blocks=1)
    assert _candidate_on_experts("2:7:8:0:p:b:2:o:2:3")[1].keywords["halves"] == 3
    assert _candidate_on_experts("2:7:8:0:p:b:2:o:2:0:1:4")[1].keywords["down_row_blocks"] == 4
    name, fn = _candidate("P:264:4:528:3:7:8:2")
    assert name == "persistent_264:4:528:3:7:8:2"
    assert _candidate_on_experts("P:264:4:528:3:7:8:2")[1].keywords == dict(
        programs=264, stages=4, down_programs=528, down_stages=3, gate_up_splits=7, down_splits=8, down_k_splits=2)
    with pytest.raises(ValueError, match="P: takes"):
        _candidate_on_experts("P:264:4")
    assert _candidate_on_experts("2:7:8:0:p:b:2:o:2:0:2")[1].keywords["choice_groups"] == 2
    assert _candidate("c:2:2:7:2")[0] == "chained_2:2:7:2" and _candidate("c:2:2:7:2:1:1")[0] == "chained_2:2:7:2:1:1"
