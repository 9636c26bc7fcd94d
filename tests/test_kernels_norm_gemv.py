"""The norm + projection kernel (model/kernels/norm_gemv.py) against its plain reference, in interpret mode, and
the layer that takes it (Kernels(norms="on")) against the one that does not."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ConfigError, Kernels
from model.decoder import forward, fuse_attention_inputs
from model.init import init_kimi_weights
from model.kernels.dispatch import norm_gemv_applies
from model.kernels.norm_gemv import NormGemvConfig, config_for, norm_gemv, norm_gemv_reference
from model.kernels.target import compiling_for
from model.kv_cache import init_latent_cache
from model.norms import rms_norm
from model.quant import Fp8Weight
from tests.tiny_models import tiny_target_config


def _operands(h, o, dtype, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (3 * jax.random.normal(k[0], (1, h))).astype(dtype)
    norm = (1 + 0.1 * jax.random.normal(k[1], (h,))).astype(dtype)
    w = (jax.random.normal(k[2], (o, h)) * h ** -0.5).astype(dtype)
    return x, norm, w


@pytest.mark.parametrize("h, o, cfg", [
    (1024, 64, NormGemvConfig(block_o=16, block_h=256)),
    (96, 36, None),  # tiles by shape: 4 rows, 32 columns a block
])
def test_matches_the_reference_float32(h, o, cfg):
    x, norm, w = _operands(h, o, jnp.float32)
    got = norm_gemv(x, norm, w, 1e-6, cfg=cfg, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(norm_gemv_reference(x, norm, w, 1e-6)), rtol=1e-5,
                               atol=1e-5)


def test_bf16_within_a_rounding_of_the_reference():
    """The norm rounds where the reference does; the sums (of squares, of products) differ only in their order, so
    the outputs are the reference's but where a float32 sum lands across a bf16 rounding boundary."""
    x, norm, w = _operands(1024, 64, jnp.bfloat16)
    got = np.asarray(norm_gemv(x, norm, w, 1e-6, cfg=NormGemvConfig(block_o=16, block_h=256), interpret=True),
                     np.float32)
    want = np.asarray(norm_gemv_reference(x, norm, w, 1e-6), np.float32)
    assert got.shape == (1, 64)
    np.testing.assert_allclose(got, want, rtol=8e-3, atol=8e-3)  # a bf16 rounding of the output
    assert np.mean(got == want) > 0.9


def test_tiles_by_shape_and_bad_input():
    assert config_for(2112, 7168) == NormGemvConfig(block_o=16, block_h=512)  # Kimi's q_a + kv_a: 132 programs
    assert config_for(36, 96) == NormGemvConfig(block_o=4, block_h=32)
    assert config_for(64, 40) is None  # 8 columns a block at most
    x, norm, w = _operands(64, 32, jnp.float32)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        norm_gemv(jnp.concatenate([x] * 9), norm, w, 1e-6, interpret=True)
    with pytest.raises(ValueError, match="disagree"):
        norm_gemv(x, norm[:32], w, 1e-6, interpret=True)
    with pytest.raises(TypeError, match="eps"):
        norm_gemv(x, norm, w, jnp.float32(1e-6), interpret=True)
    with pytest.raises(ConfigError, match="kernels.norms='auto'"):
        Kernels(norms="auto")


def test_dispatch_takes_it_when_asked_for_a_few_tokens_and_a_plain_weight():
    w = jnp.zeros((2112, 7168), jnp.bfloat16)
    on = Kernels(norms="on")
    assert not norm_gemv_applies(Kernels(), 1, 1, w)  # off by default
    assert norm_gemv_applies(on, 1, 1, w) and norm_gemv_applies(on, 1, 4, w) and not norm_gemv_applies(on, 1, 9, w)
    fp8 = Fp8Weight(jnp.zeros((2112, 7168), jnp.float8_e4m3fn), jnp.ones((17, 56), jnp.float32))
    assert not norm_gemv_applies(on, 1, 1, fp8)


def _step(w, cfg, kernels, batch, tokens):
    cfg = cfg.replace(kernels=kernels)
    tokens_BT = (7 + jnp.arange(batch * tokens, dtype=jnp.int32)).reshape(batch, tokens)
    positions_BT = jnp.broadcast_to(3 + jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    cache = init_latent_cache(cfg, batch, 16, jnp.float32)
    out = jax.jit(functools.partial(forward, cfg=cfg))(w, tokens_BT=tokens_BT, positions_BT=positions_BT, cache=cache)
    return out.logits, out.cache


@pytest.mark.parametrize("batch, tokens", [(1, 1), (1, 4), (2, 1)])  # decode, a verify, a batch's decode
def test_a_step_with_it_equals_the_one_without(batch, tokens):
    """A tiny model's step (float32), the kernels in interpret mode: the same logits and caches."""
    cfg = tiny_target_config()
    w = fuse_attention_inputs(init_kimi_weights(cfg, np.random.default_rng(3), jnp.float32))
    assert norm_gemv_applies(Kernels(norms="on"), batch, tokens, w.layers[1].attn.qkv_a_proj)  # the layers take it
    want_logits, want_cache = _step(w, cfg, Kernels(), batch, tokens)
    got_logits, got_cache = _step(w, cfg, Kernels(norms="on"), batch, tokens)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(got_cache), jax.tree_util.tree_leaves(want_cache)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_gpu_layer_runs_one_kernel_for_norm_and_projection():
    """Lowered for CUDA at Kimi-K2.5's attention input (one token), the layer passes x and the fused [2112, 7168]
    weight to the Triton kernel, and no XLA product of that weight is left."""
    from model.attention_mla import fused_attention_input
    from model.configs import known_config

    cfg = dataclasses.replace(known_config("kimi-k2.5"), kernels=Kernels(norms="on"))
    sds = jax.ShapeDtypeStruct
    attn = type("W", (), {})()  # only qkv_a_proj is read
    attn.qkv_a_proj = sds((2112, 7168), jnp.bfloat16)
    with compiling_for("gpu", "9.0"):
        text = jax.jit(lambda x, n, w: fused_attention_input(x, n, _with(attn, w), cfg)).trace(
            sds((1, 1, 7168), jnp.bfloat16), sds((7168,), jnp.bfloat16), attn.qkv_a_proj).lower(
            lowering_platforms=("cuda",)).as_text()
    jax.clear_caches()
    assert "norm_gemv" in text and "triton" in text
    assert "dot_general" not in text


def _with(attn, w):
    out = type("W", (), {})()
    out.qkv_a_proj = w
    return out


def test_on_a_mesh_every_device_runs_it_on_its_copy():
    """Under the 2 x 4 mesh the kernel runs per device on the whole row and weight (`per_device_replicated`)."""
    from model.attention_mla import fused_attention_input
    from model.sharding import make_mesh, mesh_context

    cfg = tiny_target_config().replace(kernels=Kernels(norms="on"))
    x, norm, w = _operands(cfg.hidden_size, 36, jnp.float32, seed=4)
    attn = _with(None, w)
    want = norm_gemv_reference(x, norm, w, cfg.rms_norm_eps)
    with mesh_context(make_mesh((2, 4))):
        got = jax.jit(lambda x, n, w: fused_attention_input(x, n, _with(None, w), cfg))(x[None], norm, attn.qkv_a_proj)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_the_query_by_kernel_equals_norm_then_q_b(mesh_shape):
    """q_a's norm and q_b as one kernel, over the heads each device holds under the 2 x 4 mesh (8 heads: 2 a
    device), equal XLA's norm then product."""
    from model.attention_mla import LORA_NORM_EPS, normed_query_by_kernel
    from model.sharding import make_mesh, mesh_context

    n, k, q = 8, 24, 64
    ks = jax.random.split(jax.random.PRNGKey(11), 3)
    q_a = jax.random.normal(ks[0], (1, 1, q))
    w = _with(None, None)
    w.q_a_norm = 1 + 0.1 * jax.random.normal(ks[1], (q,))
    w.q_b_proj = jax.random.normal(ks[2], (n, k, q)) * q ** -0.5
    want = jnp.einsum("btq,nkq->btnk", rms_norm(q_a, w.q_a_norm, LORA_NORM_EPS), w.q_b_proj)
    run = jax.jit(lambda a, nw, qb: normed_query_by_kernel(a, _query_weights(nw, qb), LORA_NORM_EPS))
    if mesh_shape is None:
        got = run(q_a, w.q_a_norm, w.q_b_proj)
    else:
        with mesh_context(make_mesh(mesh_shape)):
            got = run(q_a, w.q_a_norm, w.q_b_proj)
    assert got.shape == (1, 1, n, k)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _query_weights(norm, q_b):
    out = _with(None, None)
    out.q_a_norm, out.q_b_proj = norm, q_b
    return out


def test_a_wider_x_is_read_in_place():
    """x wider than the weight (the fused projection's output, q_a's columns first): the norm and the product read
    its first H columns only."""
    x, norm, w = _operands(64, 16, jnp.float32, seed=2)
    wide = jnp.concatenate([x, 100.0 * jnp.ones((1, 48))], axis=1)
    np.testing.assert_array_equal(np.asarray(norm_gemv(wide, norm, w, 1e-6, interpret=True)),
                                  np.asarray(norm_gemv(x, norm, w, 1e-6, interpret=True)))


def test_a_residual_and_float32_logits_as_the_router_takes_them():
    """norm(x + residual) through a router-shaped weight with float32 output: the router's logits (float32
    products of the bf16 values, summed in float32), within float32 rounding of the reference's."""
    x, norm, w = _operands(1024, 384, jnp.bfloat16, seed=5)
    residual = (0.5 * jax.random.normal(jax.random.PRNGKey(8), (1, 1024))).astype(jnp.bfloat16)
    got = np.asarray(norm_gemv(x, norm, w, 1e-6, residual_TH=residual, out_dtype=jnp.float32, interpret=True))
    want = np.asarray(norm_gemv_reference(x, norm, w, 1e-6, residual_TH=residual, out_dtype=jnp.float32))
    assert got.dtype == np.float32 and config_for(384, 1024).block_o == 4  # 96 programs of 4 rows
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_weights_side_by_side_in_one_launch():
    """A tuple of weights (the shared expert's gate and up): their outputs side by side, as one call each."""
    x, norm, gate = _operands(256, 48, jnp.float32, seed=6)
    up = jax.random.normal(jax.random.PRNGKey(9), (48, 256)) * 256 ** -0.5
    got = norm_gemv(x, norm, (gate, up), 1e-6, interpret=True)
    assert got.shape == (1, 96)
    np.testing.assert_allclose(np.asarray(got), np.asarray(norm_gemv_reference(x, norm, (gate, up), 1e-6)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[:, 48:]), np.asarray(norm_gemv(x, norm, up, 1e-6, interpret=True)),
                               rtol=1e-6, atol=1e-6)
    assert config_for(4096, 7168, (2048, 2048)).block_o == 16  # the whole shared expert's gate and up
    assert config_for(512, 7168, (256, 256)).block_o == 4  # a device's eighth: 128 programs of 4 rows
    assert 8 % config_for(40, 256, (8, 32)).block_o == 0  # blocks never straddle two weights


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_the_shared_experts_hidden_by_kernel_equals_swiglus(mesh_shape):
    """silu(gate) * up of norm(x + residual) by one launch, over the rows of F each device holds under the 2 x 4
    mesh, equals the XLA add, norm and products `swiglu` runs."""
    from model.mlp import MLPWeights, normed_swiglu_hidden
    from model.sharding import make_mesh, mesh_context

    cfg = tiny_target_config().replace(kernels=Kernels(norms="on"))
    h, f = cfg.hidden_size, 64
    ks = jax.random.split(jax.random.PRNGKey(12), 5)
    x, residual = jax.random.normal(ks[0], (1, 1, h)), jax.random.normal(ks[1], (1, 1, h))
    norm = 1 + 0.1 * jax.random.normal(ks[2], (h,))
    w = MLPWeights(jax.random.normal(ks[3], (f, h)) * h ** -0.5, jax.random.normal(ks[4], (f, h)) * h ** -0.5,
                   jnp.zeros((h, f)))
    n = rms_norm(x + residual, norm, cfg.rms_norm_eps)[0]
    want = jax.nn.silu(n @ w.gate.T) * (n @ w.up.T)
    run = jax.jit(lambda *a: normed_swiglu_hidden(*a, cfg))
    if mesh_shape is None:
        got = run(x, residual, norm, w)
    else:
        with mesh_context(make_mesh(mesh_shape)):
            got = run(x, residual, norm, w)
    assert got.shape == (1, f)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [2, 3, 4, 5, 8])  # 3, 5: rows past them computed as zeros, not stored
def test_several_tokens_each_normed_on_its_own(tokens):
    """Verify's tokens (or a batch's): each row normed with its own sum of squares, every weight block read once
    for all of them; with a residual and float32 output as the router takes them."""
    k = jax.random.split(jax.random.PRNGKey(tokens), 4)
    x = (jax.random.normal(k[0], (tokens, 512)) * jnp.arange(1, tokens + 1)[:, None]).astype(jnp.bfloat16)
    residual = jax.random.normal(k[1], (tokens, 512)).astype(jnp.bfloat16)
    norm = (1 + 0.1 * jax.random.normal(k[2], (512,))).astype(jnp.bfloat16)
    w = (jax.random.normal(k[3], (128, 512)) * 512 ** -0.5).astype(jnp.bfloat16)
    got = np.asarray(norm_gemv(x, norm, w, 1e-6, residual_TH=residual, out_dtype=jnp.float32, interpret=True))
    want = np.asarray(norm_gemv_reference(x, norm, w, 1e-6, residual_TH=residual, out_dtype=jnp.float32))
    assert got.shape == (tokens, 128)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cfg = config_for(128, 512, tokens=tokens)
    assert cfg.block_o * cfg.block_h * tokens <= 8192  # the products' block stays in registers
    assert config_for(128, 512, tokens=9) is None


@pytest.mark.parametrize("tokens", [1, 3])  # a draft step, the draft's extend over accepted tokens
def test_the_drafts_mlp_and_logits_by_kernel_equal_xlas(tokens):
    """The EAGLE-3 draft's post-attention norm with its MLP's gate and up, and its final norm with its lm_head,
    by the norm + projection kernel (Kernels(norms="on"), interpret mode): the same logits, hidden state and
    cache as without (float32)."""
    from model.eagle3 import draft_forward, init_draft_cache
    from model.init import init_draft_weights
    from tests.tiny_models import tiny_draft_config

    cfg = tiny_target_config()
    dcfg = tiny_draft_config(cfg)
    dw = init_draft_weights(dcfg, np.random.default_rng(4), d2t=np.zeros(dcfg.draft_vocab_size, np.int64),
                            dtype=jnp.float32)
    tw = init_kimi_weights(cfg, np.random.default_rng(5), jnp.float32)
    rng = np.random.default_rng(6)
    toks = jnp.asarray(rng.integers(1, cfg.vocab_size, size=(1, tokens)), jnp.int32)
    aux = jnp.asarray(rng.standard_normal((1, tokens, dcfg.aux_width)), jnp.float32)
    pos = jnp.arange(tokens, dtype=jnp.int32)[None] + 5
    outs = []
    for kernels in (Kernels(), Kernels(norms="on")):
        c = dataclasses.replace(dcfg, kernels=kernels)
        outs.append(jax.jit(lambda t, h, p, cache, c=c: draft_forward(dw, c, tw.embed, tw.lm_head, t, h, p, cache))(
            toks, aux, pos, init_draft_cache(c, 1, 16, jnp.float32)))
    assert norm_gemv_applies(Kernels(norms="on"), 1, tokens, (dw.mlp.gate, dw.mlp.up))
    for got, want in zip(jax.tree_util.tree_leaves(outs[1]), jax.tree_util.tree_leaves(outs[0])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_the_engine_generates_the_same_tokens_with_them(mesh_shape):
    """Greedy generation by the engine (prefill, cycles of K = 2 drafts and a verify of 3, the drafts' extend) with
    Kernels(norms="on") for the target and the draft, in interpret mode, on one device and on the 2 x 4 mesh: the
    tokens it gives without them."""
    from jaxspec.engine import Engine
    from jaxspec.models import SpecConfig
    from jaxspec.sampling import SamplingParams
    from model.sharding import make_mesh
    from tests.tiny_models import tiny_pair

    cfg, w = tiny_pair(seed=4)
    on = Kernels(norms="on")
    cfg_on = SpecConfig(cfg.target.replace(kernels=on), dataclasses.replace(cfg.draft, kernels=on), cfg.eos_ids)
    mesh = None if mesh_shape is None else make_mesh(mesh_shape)
    prompts = [[3, 9, 1, 7]]
    want = Engine(cfg, w, num_steps=2, mesh=mesh).generate(prompts, max_new_tokens=8, sampling=SamplingParams())
    got = Engine(cfg_on, w, num_steps=2, mesh=mesh).generate(prompts, max_new_tokens=8, sampling=SamplingParams())
    assert got.tokens == want.tokens and len(got.tokens[0]) == 8
