"""o_proj's rows read into L2 ahead of it (model.kernels.l2_prefetch, `Kernels(prefetch=...)`): the kernel returns
what its plain reference computes (Pallas interpret mode on the CPU), the forward with it gives bit for bit the
forward without it, and the read-ahead is taken only where it is meant to run."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ConfigError, Kernels
from model.decoder import forward
from model.init import init_kimi_weights
from model.kernels import l2_prefetch as lp
from model.kernels.dispatch import PREFETCH_MAX_TOKENS, prefetch_rows_for
from model.kv_cache import init_latent_cache
from tests.tiny_models import tiny_target_config


@pytest.mark.parametrize("rows,cols", [(16, 16), (64, 1024), (48, 3072), (32, 96)])
def test_kernel_equals_its_reference(rows, cols):
    w = jax.random.normal(jax.random.key(rows + cols), (rows + 16, cols), jnp.float32).astype(jnp.bfloat16)
    dep = jnp.arange(32, dtype=jnp.float32).reshape(1, 32)
    got = lp.l2_prefetch_tiles(dep, w, rows, interpret=True)
    want = lp.l2_prefetch_reference(dep, w, rows)
    assert got.shape == want.shape == (rows // lp.BLOCK_ROWS * (cols // lp.block_cols(cols)), lp.DEP)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(lp.l2_prefetch(dep, w, rows, interpret=True)), np.asarray(want[0, :1]))


def test_kernel_refuses_what_it_cannot_tile():
    w = jnp.zeros((64, 1024), jnp.bfloat16)
    dep = jnp.zeros((1, 32), jnp.float32)
    for rows in (0, 8, 24, 80):  # none, not whole tiles, more than the weight has
        with pytest.raises(ValueError, match="l2_prefetch"):
            lp.l2_prefetch(dep, w, rows, interpret=True)
    with pytest.raises(ValueError, match="dep"):
        lp.l2_prefetch(jnp.zeros((1, 8)), w, 16, interpret=True)
    assert lp.block_cols(7) is None and lp.block_cols(8192) == 1024 and lp.block_cols(96) == 32


def test_rows_follow_the_budget():
    # Kimi-K2.5's o_proj [7168, 64 * 128] bf16: 16 KB a row
    assert prefetch_rows_for("o_proj", Kernels(prefetch="o_proj16"), (7168, 8192), 2, 1) == 976
    assert prefetch_rows_for("o_proj", Kernels(prefetch="o_proj32"), (7168, 8192), 2, 1) == 1952
    # one device of eight: [7168, 8 * 128], 14.7 MB, read whole
    assert prefetch_rows_for("o_proj", Kernels(prefetch="o_proj16"), (7168, 1024), 2, 4) == 7168
    assert prefetch_rows_for("o_proj", Kernels(), (7168, 8192), 2, 1) == 0  # off by default
    assert prefetch_rows_for("o_proj", Kernels(prefetch="o_proj16"), (7168, 8192), 2, PREFETCH_MAX_TOKENS + 1) == 0
    with pytest.raises(ConfigError, match="kernels.prefetch"):
        Kernels(prefetch="o_proj64")


def _logits(cfg, w, tokens_BT):
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    fn = jax.jit(lambda w, tok, pos, cache: forward(w, cfg, tok, pos, cache).logits)
    cache = init_latent_cache(cfg, b, 16, jnp.float32)
    return fn(w, tokens_BT, positions_BT, cache), jax.make_jaxpr(fn)(w, tokens_BT, positions_BT, cache)


@pytest.mark.parametrize("t", [1, 3])
def test_forward_with_the_read_ahead_is_the_forward_without(t):
    cfg = tiny_target_config(num_attention_heads=4)  # 16 rope values a token start the kernel
    w = init_kimi_weights(cfg, np.random.default_rng(3), jnp.float32)
    tokens = jax.random.randint(jax.random.key(2), (1, t), 0, cfg.vocab_size)
    want, plain = _logits(cfg, w, tokens)
    on = dataclasses.replace(cfg, kernels=Kernels(prefetch="o_proj16"))
    got, read_ahead = _logits(on, w, tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "l2_prefetch" not in str(plain)
    assert str(read_ahead).count("name=l2_prefetch") == 2  # o_proj's in each kind of layer, dense and MoE


def test_a_mesh_reads_each_devices_block_and_generates_the_same_tokens():
    """On a (2, 4) mesh each device reads its own heads' block of o_proj and q_b (inside shard_map, as the MLA
    kernels run), and greedy decoding emits the tokens it emits without the read-ahead."""
    from jaxspec.engine import Engine
    from jaxspec.sampling import SamplingParams
    from model.sharding import make_mesh, mesh_context
    from tests.tiny_models import tiny_pair

    # heads split 4 ways: a device's o_proj block [32, 1 * 16] and roped query [1, 1, 1, 16] are the least the
    # kernel reads
    cfg, w = tiny_pair(seed=6, num_attention_heads=4, qk_rope_head_dim=16, v_head_dim=16)
    mesh = make_mesh((2, 4))
    plain = Engine(cfg, w, num_steps=2, mesh=mesh).generate([[3, 9, 1, 7]], 6, SamplingParams())
    on = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, kernels=Kernels(prefetch="q_b16_o_proj16")))
    eng = Engine(on, w, num_steps=2, mesh=mesh)
    got = eng.generate([[3, 9, 1, 7]], 6, SamplingParams())
    assert got.tokens == plain.tokens
    tokens = jnp.asarray([[3]], jnp.int32)
    with mesh_context(mesh):
        text = str(jax.make_jaxpr(lambda w_: forward(w_, on.target, tokens, tokens, init_latent_cache(
            on.target, 1, 16, jnp.float32)).logits)(eng.weights.target))
    # q_b's and o_proj's in each kind of layer, dense and MoE (model.decoder traces a kind of layer once)
    assert text.count("name=l2_prefetch") == 2 * 2
