"""The planner counts exactly the bytes the sharded arrays hold per device, and Kimi-K2.5 (INT4 experts)
fits 8 x H200 at 131072 tokens of context."""

from collections import defaultdict

import jax
import pytest

from jaxspec import plan
from jaxspec.models import SpecWeights
from jaxspec.prefill import MIN_BUCKET
from jaxspec.sharded import place, place_weights
from model.sharding import CACHE_RULES, DRAFT_RULES, TARGET_RULES, make_mesh, path_str, shardings_for
from tests.sharded_pair import numpy_like, sharded_config
from tests.tiny_models import tiny_draft_config


def resident_bytes(tree) -> dict:
    """{device: {(category, format): bytes}} summed from the arrays' addressable shards."""
    out = defaultdict(lambda: defaultdict(int))
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = (plan.weight_category(path_str(path)), plan.weight_format(path_str(path), leaf.dtype))
        for shard in leaf.addressable_shards:
            out[shard.device][key] += shard.data.nbytes
    return out


@pytest.mark.parametrize("experts,shape", [("int4", (2, 4)), ("fp8", (1, 8)), ("bf16", (8, 1))],
                         ids=["int4-2x4", "fp8-1x8", "bf16-8x1"])
def test_planner_bytes_equal_resident_bytes_per_device(experts, shape):
    cfg = sharded_config()
    dcfg = tiny_draft_config(cfg, draft_vocab=24)
    target_abs, draft_abs = plan.abstract_target(cfg, experts), plan.abstract_draft(dcfg)
    mesh, abstract_mesh = make_mesh(shape), plan.abstract_mesh(shape)

    # laid out as the engine lays them out
    weights = place_weights(SpecWeights(numpy_like(target_abs, 0), numpy_like(draft_abs, 1)), mesh)
    target_cache, draft_cache = plan.abstract_caches(cfg, dcfg, batch=8, capacity=64)
    caches = [place(numpy_like(c, 2), shardings_for(c, mesh, CACHE_RULES)) for c in (target_cache, draft_cache)]

    planned = {
        "target": plan.bytes_by_category(target_abs, abstract_mesh, TARGET_RULES),
        "draft": plan.bytes_by_category(draft_abs, abstract_mesh, DRAFT_RULES),
        "caches": sum(plan.bytes_per_device(c, abstract_mesh, CACHE_RULES) for c in (target_cache, draft_cache)),
    }
    resident = {"target": resident_bytes(weights.target), "draft": resident_bytes(weights.draft)}
    cache_resident = [resident_bytes(c) for c in caches]
    assert len(mesh.devices.flat) == 8
    for device in mesh.devices.flat:
        assert dict(resident["target"][device]) == planned["target"]
        assert dict(resident["draft"][device]) == planned["draft"]
        assert sum(sum(r[device].values()) for r in cache_resident) == planned["caches"]
    # the model really is split: experts over all 8 devices, so each holds 1/8 of them
    full = plan.bytes_by_category(target_abs, plan.abstract_mesh((1, 1)), TARGET_RULES)
    routed = [k for k in full if k[0] == "routed experts"]
    assert sum(planned["target"][k] for k in routed) * 8 == sum(full[k] for k in routed)


def test_kimi_k25_int4_fits_eight_h200(capsys):
    p = plan.make_plan("kimi-k2.5", devices=8, device_memory=141 * plan.GB, context=131072, batch=1)
    cfg = plan.known_config("kimi-k2.5")
    # routed experts: 60 MoE layers x 384/8 experts x 3 matrices of 2048 x 7168 (int4 + a bf16 scale per 32)
    per_matrix = 2048 * 7168 // 2 + 2048 * 7168 // 32 * 2
    routed = sum(n for (cat, _), n in p.target_weights.items() if cat == "routed experts")
    assert routed == 60 * 48 * 3 * per_matrix
    assert p.kv["target latent (MLA, 512/token/layer)"] == cfg.num_hidden_layers * 131072 * 512 * 2
    assert p.kv["draft KV cache"] == 2 * 131072 * 64 * 128 * 2  # replicated: the draft runs on every device
    assert p.fits and 30 * plan.GB < p.headroom < 60 * plan.GB

    assert plan.main(["--config", "kimi-k2.5", "--devices", "8", "--device-memory", "141GB", "--context", "131072",
                      "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "FITS: headroom" in out and "routed experts" in out and "int4 packed" in out

    # bf16 experts (about 2 TB in all) cannot fit 8 x 141 GB
    assert not plan.make_plan("kimi-k2.5", 8, 141 * plan.GB, 131072, 1, experts="bf16").fits


def test_the_servers_prefix_cache_is_counted_as_its_pool_holds_it():
    """Whole pages of every cache, held by every device: the bytes `init_prefix_pages` allocates."""
    from jaxspec.serving.prefix_pages import PAGE_TOKENS, init_prefix_pages

    base = plan.make_plan("kimi-k2.5", devices=8, device_memory=141 * plan.GB, context=8192, batch=4)
    p = plan.make_plan("kimi-k2.5", devices=8, device_memory=141 * plan.GB, context=8192, batch=4,
                       prefix_cache_tokens=1000)  # 15 whole pages
    cfg, dcfg = plan.known_config("kimi-k2.5"), plan.known_draft_config(p.draft)
    target, draft = plan.abstract_caches(cfg, dcfg, 1, PAGE_TOKENS)
    pool = jax.eval_shape(lambda: init_prefix_pages(target, draft, 1000 // PAGE_TOKENS))
    assert p.kv[f"prefix cache (15 pages of {PAGE_TOKENS})"] == sum(x.size * x.dtype.itemsize for x in pool.arrays)
    assert p.total - base.total == sum(x.size * x.dtype.itemsize for x in pool.arrays)


def test_the_target_cache_is_split_over_data_as_the_engine_splits_it():
    cfg = plan.known_config("kimi-k2.5")
    for shape, split in (((1, 8), 1), ((2, 4), 2)):
        p = plan.make_plan("kimi-k2.5", devices=8, device_memory=141 * plan.GB, context=8192, batch=16,
                           mesh_shape=shape)
        assert p.kv["target latent (MLA, 512/token/layer)"] == cfg.num_hidden_layers * 16 * 8192 * 512 * 2 // split
        assert p.kv["target rope key (64/token/layer)"] == cfg.num_hidden_layers * 16 * 8192 * 64 * 2 // split


def test_a_paged_cache_is_counted_as_its_pool():
    """--cache-pages: the target's cache and the draft's are each one pool of that many pages, whatever the batch
    and context; the draft's attention reads its pages gathered into contiguous caches, counted as working memory."""
    from jaxspec.serving.prefix_pages import PAGE_TOKENS

    p = plan.make_plan("kimi-k2.5", devices=8, device_memory=141 * plan.GB, context=8192, batch=16, cache_pages=256)
    cfg = plan.known_config("kimi-k2.5")
    assert p.kv["target latent (MLA, 512/token/layer)"] == cfg.num_hidden_layers * 256 * PAGE_TOKENS * 512 * 2
    assert p.kv["target rope key (64/token/layer)"] == cfg.num_hidden_layers * 256 * PAGE_TOKENS * 64 * 2
    dcfg = plan.known_draft_config(p.draft)
    assert p.kv["draft KV cache"] == 2 * 256 * PAGE_TOKENS * dcfg.num_key_value_heads * dcfg.head_dim * 2
    # ... but each draft step gathers every sequence's pages into its contiguous K and V (batch x context)
    view = p.working["draft cache pages read contiguous"]
    assert view == 16 * 8192 * 2 * dcfg.num_key_value_heads * dcfg.head_dim * 2


def test_sizes_in_exponent_notation_and_out_of_range_flags(capsys):
    """--device-memory takes 1.5e11, the form its own error message gives as an example; counts that are zero or
    negative are refused with the flag named (they raised a traceback, or printed a plan with negative bytes that
    FITS)."""
    assert plan.parse_bytes("1.5e11") == 150 * plan.GB and plan.parse_bytes("1E3KB") == 10**6
    capsys.readouterr()
    bad = [("--devices", "0"), ("--devices", "-8"), ("--batch", "0"), ("--batch", "-1"), ("--context", "0"),
           ("--num-steps", "-1"), ("--prefix-cache-tokens", "-64"), ("--cache-pages", "0"), ("--cache-pages", "-3"),
           ("--device-memory", "0")]
    for flag, value in bad:
        assert plan.main([flag, value]) == 2, (flag, value)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, as generate's and convert's
        assert f"{flag} must be" in err and "Traceback" not in err, (flag, value, err)
    for argv, needle in ((["--mesh", "3"], "--mesh"), (["--device-memory", "12X"], "--device-memory"),
                         (["--mesh", "2x2"], "does not have 8 devices")):
        assert plan.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def test_short_contexts_get_the_prefill_chunk_they_run_in():
    """A prompt shorter than the smallest bucket runs as one chunk of MIN_BUCKET tokens, and one filling a short
    context as one chunk of its bucket: the plan tests those (it printed "chunks up to 0 tokens ... --prefill-chunk
    <= 0" for a context under 16), and the default chunk only has to fit where a prompt can be that long."""
    for context, chunk in ((1000, 1024), (100, 128), (8, MIN_BUCKET)):
        p = plan.make_plan("kimi-k2.5", devices=8, device_memory=141 * plan.GB, context=context, batch=1)
        assert p.prefill_max_chunk == chunk, context
        assert "does not" not in plan.format_plan(p).splitlines()[-1]
    # a device that holds the weights, caches and a cycle's buffers, and no prefill chunk's
    tight = plan.make_plan("kimi-k2.5", devices=8, device_memory=p.total + 1, context=8, batch=1)
    assert tight.fits and tight.prefill_max_chunk == 0
    assert "no prefill chunk fits" in plan.format_plan(tight).splitlines()[-1]
