"""The EAGLE-3 draft layer against an independent float64 numpy implementation of REFERENCE.md section 5."""

import jax
import jax.numpy as jnp
import numpy as np

from model.eagle3 import draft_forward, draft_to_target_ids, init_draft_cache
from tests.tiny_models import tiny_pair


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _neox(x_TND, pos_T, theta):
    d = x_TND.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos_T[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x_TND[..., : d // 2], x_TND[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def numpy_draft(dw, cfg, embed, lm_head, tokens_T, h_TX, pos_T, past_k=None, past_v=None):
    """One sequence; h is fc'd when 3H wide; attention over past (k, v) plus the T new tokens, causal."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    e = f(embed)[tokens_T]
    h = h_TX @ f(dw.fc).T if h_TX.shape[-1] != cfg.hidden_size else h_TX
    x = np.concatenate([_rms(e, f(dw.input_norm), cfg.rms_norm_eps), _rms(h, f(dw.hidden_norm), cfg.rms_norm_eps)], -1)
    t, n, nkv, d = len(tokens_T), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = _neox((x @ f(dw.q_proj).T).reshape(t, n, d), pos_T, cfg.rope_theta)
    k = _neox((x @ f(dw.k_proj).T).reshape(t, nkv, d), pos_T, cfg.rope_theta)
    v = (x @ f(dw.v_proj).T).reshape(t, nkv, d)
    if past_k is not None:
        k, v = np.concatenate([past_k, k]), np.concatenate([past_v, v])
    s = k.shape[0]
    qpos = pos_T[:, None]
    kpos = np.arange(s)[None]
    out = np.zeros((t, n, d))
    for head in range(n):
        kv = head // (n // nkv)
        sc = q[:, head] @ k[:, kv].T / np.sqrt(d)
        sc = np.where(kpos <= qpos, sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, head] = p @ v[:, kv]
    residual = h + out.reshape(t, n * d) @ f(dw.o_proj).T
    m = _rms(residual, f(dw.post_attention_norm), cfg.rms_norm_eps)
    g, u = m @ f(dw.mlp.gate).T, m @ f(dw.mlp.up).T
    y = residual + ((g / (1 + np.exp(-g))) * u) @ f(dw.mlp.down).T
    head_w = f(lm_head if dw.lm_head is None else dw.lm_head)
    logits = _rms(y, f(dw.final_norm), cfg.rms_norm_eps) @ head_w.T
    return logits, y, k, v


def test_draft_layer_matches_float64_numpy():
    cfg, w = tiny_pair(seed=5, draft_vocab=40)
    dcfg, dw, tw = cfg.draft, w.draft, w.target
    rng = np.random.default_rng(0)
    t = 6
    tokens = rng.integers(0, cfg.target.vocab_size, t)
    aux = rng.standard_normal((t, dcfg.aux_width)).astype(np.float32)
    cache = init_draft_cache(dcfg, 1, 16, jnp.float32)
    # jitted, as the engine runs it (op by op, every operation would compile on its own)
    forward = jax.jit(draft_forward, static_argnums=1)
    out = forward(dw, dcfg, tw.embed, tw.lm_head, jnp.asarray(tokens)[None], jnp.asarray(aux)[None],
                  jnp.arange(t)[None], cache)
    ref_logits, ref_hidden, k, v = numpy_draft(dw, dcfg, tw.embed, tw.lm_head, tokens, aux.astype(np.float64), np.arange(t))
    np.testing.assert_allclose(np.asarray(out.logits[0]), ref_logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out.hidden[0]), ref_hidden, atol=1e-5, rtol=0)

    # a drafting step: the draft's own output (width H) as h, attending to the cached positions
    tok = np.array([int(rng.integers(0, cfg.target.vocab_size))])
    step = forward(dw, dcfg, tw.embed, tw.lm_head, jnp.asarray(tok)[None], out.hidden[:, -1:],
                   jnp.array([[t]]), out.cache)
    ref2, ref_h2, _, _ = numpy_draft(dw, dcfg, tw.embed, tw.lm_head, tok, ref_hidden[-1:], np.array([t]), k, v)
    np.testing.assert_allclose(np.asarray(step.logits[0]), ref2, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(step.hidden[0]), ref_h2, atol=1e-5, rtol=0)


def test_d2t_maps_draft_ids_to_target_ids():
    cfg, w = tiny_pair(seed=5, draft_vocab=40)
    ids = np.asarray(draft_to_target_ids(w.draft, jnp.arange(40)))
    assert len(set(ids.tolist())) == 40 and ids.min() >= 0 and ids.max() < cfg.target.vocab_size
    assert np.all(np.diff(ids) > 0)  # tiny_pair picks the draft vocabulary as sorted target ids
    assert jax.numpy.array_equal(draft_to_target_ids(w.draft, jnp.asarray([0])), jnp.asarray([ids[0]]))
