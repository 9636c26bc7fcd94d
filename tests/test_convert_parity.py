"""Converted checkpoints (bf16, FP8 block, INT4, K2.5 nesting, EAGLE-3 drafter) load onto an 8-device mesh
and match the reference: HF logits on the dequantized weights (float32, 1e-4), or float64 numpy for the draft."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.torch import load_file

from convert.check import check_conversion
from convert.hf_draft_weights import load_hf_draft
from convert.checkpoint import COMPLETE_MARKER, FORMAT_VERSION, METADATA_FILE, load_draft, load_target
from convert.stream import ConvertOptions, convert_checkpoint
from model.decoder import forward
from model.eagle3 import draft_forward, init_draft_cache
from model.kv_cache import init_latent_cache
from model.quant import Fp8Weight, Int4Weight
from model.sharding import make_mesh
from tests import convert_fixtures as fx
from tests.hf_tiny import hf_logits

TOL = 1e-4
EXPERTS = P(("data", "model"), None, None)
jit_forward = jax.jit(forward, static_argnames=("cfg", "attention"))

WRITERS = {
    "bf16": lambda src, scratch: fx.bf16_checkpoint(src),
    "fp8": fx.fp8_checkpoint,
    "int4": fx.int4_checkpoint,
    "k25": fx.k25_checkpoint,
}
EXPERT_TYPE = {"bf16": jax.Array, "fp8": Fp8Weight, "int4": Int4Weight, "k25": Int4Weight}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = root / "src"
    src.mkdir()
    ref = WRITERS[request.param](src, root / "scratch")
    lines = []
    dst = convert_checkpoint(src, root / "dst", ConvertOptions(dtype="float32", progress=False), lines.append)
    return request.param, src, dst, ref, lines


def test_logits_match_hf_on_8_devices(converted):
    kind, src, dst, ref, _ = converted
    mesh = make_mesh()
    assert mesh.devices.size == 8
    cfg, w = load_target(dst, mesh, dtype=jnp.float32)
    b, t = 2, 12
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(b, t))
    want, _ = hf_logits(ref, tokens)
    cache = init_latent_cache(cfg, b, 16, jnp.float32)
    out = jit_forward(w, cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)), cache)
    np.testing.assert_allclose(np.asarray(out.logits), want, atol=TOL, rtol=0)


def test_arrays_restore_into_partitioned_named_shardings(converted):
    kind, _, dst, _, _ = converted
    cfg, w = load_target(dst, make_mesh(), dtype=jnp.float32)
    moe = w.layers[1].mlp
    assert isinstance(moe.experts.gate, EXPERT_TYPE[kind])
    for leaf in jax.tree_util.tree_leaves(moe.experts):
        assert leaf.sharding.spec == EXPERTS  # 16 experts over 8 devices
        assert len(leaf.sharding.device_set) == 8
    assert w.layers[0].attn.q_b_proj.sharding.spec == P("model", None, None)  # 8 heads, tensor parallel
    assert w.layers[0].attn.o_proj.sharding.spec == P(None, "model", None)
    assert w.layers[0].mlp.gate.sharding.spec == P("model", None)  # dense MLP
    assert moe.shared.down.sharding.spec == P(None, "model")
    assert w.lm_head.sharding.spec == P("model", None) and w.embed.sharding.spec == P("model", None)


def test_default_device_and_dtype_rules(converted):
    """Without a mesh: one device. bf16 cast touches dense floats only, never INT4 words / FP8 bytes / router."""
    kind, _, dst, _, _ = converted
    cfg, w = load_target(dst)
    assert w.embed.dtype == jnp.bfloat16 and w.layers[0].attn.w_uk.dtype == jnp.bfloat16
    assert w.embed.sharding.device_set == {jax.devices()[0]}
    moe = w.layers[1].mlp
    assert moe.router.dtype == jnp.bfloat16 and moe.router_bias.dtype == jnp.float32  # as the checkpoint stores them
    if kind in ("int4", "k25"):
        assert moe.experts.gate.packed.dtype == jnp.uint32 and moe.experts.gate.scale.dtype == jnp.bfloat16
    elif kind == "fp8":
        assert moe.experts.down.weight.dtype == ml_dtypes.float8_e4m3fn
        assert moe.experts.down.scale_inv.dtype == jnp.float32
    else:
        assert moe.experts.up.dtype == jnp.bfloat16


def test_layout_metadata_and_tokenizer_files(converted):
    kind, src, dst, _, lines = converted
    assert (dst / COMPLETE_MARKER).exists() and not dst.with_name(dst.name + ".partial").exists()
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    meta = json.loads((dst / METADATA_FILE).read_text())
    assert meta["kind"] == "target" and meta["dtype"] == "float32" and meta["format_version"] == FORMAT_VERSION == 2
    assert meta["experts"] == {"bf16": "float32", "fp8": "fp8", "int4": "int4", "k25": "int4"}[kind]
    assert meta["items"] == ["embed", "layer_000", "layer_001", "layer_002", "head"]
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    if kind == "bf16":
        assert (dst / "generation_config.json").exists()  # save_pretrained wrote one
    if kind == "k25":
        assert meta["skipped"]["vision"] == 2
        assert any("skipping 2 vision tensors" in line for line in lines)


def test_check_mode_passes(converted):
    _, src, dst, _, _ = converted
    out = []
    assert check_conversion(src, dst, samples=40, log=out.append) == 0
    assert "40 of 40 sampled tensors match" in out[-1]


def test_experts_dequantized_on_request(tmp_path):
    """--experts bf16 on an INT4 source: dense experts equal to the dequantized INT4 values."""
    src = tmp_path / "src"
    src.mkdir()
    fx.int4_checkpoint(src, tmp_path / "scratch", num_hidden_layers=2)
    opts = ConvertOptions(dtype="float32", experts="bf16", progress=False)
    dst = convert_checkpoint(src, tmp_path / "dst", opts, print)
    assert json.loads((dst / METADATA_FILE).read_text())["experts"] == "float32"
    cfg, w = load_target(dst, make_mesh(), dtype=jnp.float32)
    gate = w.layers[1].mlp.experts.gate
    assert isinstance(gate, jax.Array) and gate.sharding.spec == EXPERTS
    dequantized = load_file(tmp_path / "scratch" / "ref" / "model.safetensors")
    for e in (0, 3, 15):
        want = dequantized[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].numpy()
        np.testing.assert_array_equal(np.asarray(gate)[e], want)


# ---------------------------------------------------------------------------------------------------
# EAGLE-3 drafter
# ---------------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _neox(x_BTND, positions_T, theta):
    d = x_BTND.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions_T[:, None] * inv[None]
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    x1, x2 = x_BTND[..., : d // 2], x_BTND[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def draft_reference(t: dict, c: dict, tokens_BT, aux_BTX):
    """Float64 numpy EAGLE-3 step over T fresh positions (REFERENCE.md section 5), written from scratch."""
    b, s = tokens_BT.shape
    h, n, kv, d, eps = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    m = "midlayer."
    e = t["embed_tokens.weight"][tokens_BT]
    hid = aux_BTX @ t["fc.weight"].T
    x = np.concatenate([_rms(e, t[m + "input_layernorm.weight"], eps), _rms(hid, t[m + "hidden_norm.weight"], eps)], -1)
    pos = np.arange(s, dtype=np.float64)
    q = _neox((x @ t[m + "self_attn.q_proj.weight"].T).reshape(b, s, n, d), pos, c["rope_theta"])
    k = _neox((x @ t[m + "self_attn.k_proj.weight"].T).reshape(b, s, kv, d), pos, c["rope_theta"])
    v = (x @ t[m + "self_attn.v_proj.weight"].T).reshape(b, s, kv, d)
    k, v = np.repeat(k, n // kv, axis=2), np.repeat(v, n // kv, axis=2)
    scores = np.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("bnts,bsnd->btnd", p, v).reshape(b, s, n * d) @ t[m + "self_attn.o_proj.weight"].T
    resid = hid + attn
    y = _rms(resid, t[m + "post_attention_layernorm.weight"], eps)
    gate, up = y @ t[m + "mlp.gate_proj.weight"].T, y @ t[m + "mlp.up_proj.weight"].T
    out = resid + ((gate / (1 + np.exp(-gate))) * up) @ t[m + "mlp.down_proj.weight"].T
    logits = _rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T
    return logits, out


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    src = root / "src"
    src.mkdir()
    tensors = fx.drafter_checkpoint(src)
    dst = convert_checkpoint(src, root / "dst", ConvertOptions(dtype="float32", progress=False), print)
    return src, dst, tensors


def test_drafter_tensors_exact_and_replicated(drafter):
    src, dst, t = drafter
    cfg, w = load_draft(dst, make_mesh(), dtype=jnp.float32)
    assert cfg.draft_vocab_size == 32 and cfg.aux_layer_ids == (0, 1, 2)
    m = "midlayer."
    pairs = {
        "fc.weight": w.fc, m + "input_layernorm.weight": w.input_norm, m + "hidden_norm.weight": w.hidden_norm,
        m + "post_attention_layernorm.weight": w.post_attention_norm, m + "self_attn.q_proj.weight": w.q_proj,
        m + "self_attn.k_proj.weight": w.k_proj, m + "self_attn.v_proj.weight": w.v_proj,
        m + "self_attn.o_proj.weight": w.o_proj, m + "mlp.gate_proj.weight": w.mlp.gate,
        m + "mlp.up_proj.weight": w.mlp.up, m + "mlp.down_proj.weight": w.mlp.down, "norm.weight": w.final_norm,
        "lm_head.weight": w.lm_head, "embed_tokens.weight": w.embed,
    }
    for name, got in pairs.items():
        np.testing.assert_array_equal(np.asarray(got, np.float64), t[name], err_msg=name)
    assert w.d2t.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(w.d2t), t["d2t"])
    hf_cfg, hf_w = load_hf_draft(src, np.float32)  # the direct HF loader (no conversion) agrees
    assert hf_cfg == cfg
    for a, b in zip(jax.tree_util.tree_leaves(hf_w), jax.tree_util.tree_leaves(w)):
        np.testing.assert_array_equal(a, np.asarray(b))
    for leaf in jax.tree_util.tree_leaves(w):
        assert leaf.sharding.spec == P() and len(leaf.sharding.device_set) == 8


def test_drafter_forward_matches_float64_numpy(drafter):
    src, dst, t = drafter
    cfg, w = load_draft(dst, make_mesh(), dtype=jnp.float32)
    rng = np.random.default_rng(1)
    b, s, h = 2, 7, cfg.hidden_size
    tokens = rng.integers(0, cfg.vocab_size, size=(b, s))
    aux = rng.standard_normal((b, s, 3 * h))
    target_embed = jnp.zeros((cfg.vocab_size, h), jnp.float32)  # unused: the drafter has its own
    out = jax.jit(draft_forward, static_argnames="cfg")(
        w, cfg, target_embed, target_embed, jnp.asarray(tokens), jnp.asarray(aux, jnp.float32),
        jnp.broadcast_to(jnp.arange(s), (b, s)), init_draft_cache(cfg, b, 8, jnp.float32),
    )
    want_logits, want_hidden = draft_reference(t, fx.DRAFT_TINY, tokens, aux.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(np.asarray(out.hidden), want_hidden, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out.logits), want_logits, atol=TOL, rtol=0)
    ids = np.asarray(w.d2t)[np.arange(cfg.draft_vocab_size)] + np.arange(cfg.draft_vocab_size)
    assert np.array_equal(np.flatnonzero(t["t2d"]), ids)  # d2t maps onto exactly the t2d ids


def test_drafter_check_mode(drafter):
    src, dst, _ = drafter
    out = []
    assert check_conversion(src, dst, log=out.append) == 0
    assert "draft tensors match" in out[-1]
