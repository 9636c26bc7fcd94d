"""Tiny EAGLE-3 MLA drafters (`Eagle3DeepseekV2ForCausalLM`, plain and EAGLE-3.1) written with safetensors in the
published layout, and an independent PyTorch implementation of their forward (test helpers).

The reference follows the published definition (vLLM `deepseek_eagle3.py`, TorchSpec `deepseek_eagle.py`;
docs/drafters.md): per-chunk fc_norm then fc, cat(input_layernorm(e), hidden_norm(h)), DeepSeek MLA with its K
and V expanded per head (not the absorbed form jaxspec runs), interleaved YaRN rope, residual MLP, final norm; the
next step's h is the final-normed output when norm_output is set. Its cache is written per absolute position, so it
follows the engine's overwrite-on-rejection through several cycles.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

# kind -> the config.json keys that differ between the drafter forms
KINDS = {
    "mla": dict(q_lora_rank=16, rope_scaling=None, draft_vocab_size=40),
    "mla31": dict(q_lora_rank=16, fc_norm=True, norm_output=True, draft_vocab_size=None,
                  rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def mla_drafter_config(kind: str, vocab: int, hidden: int, aux_ids: list[int]) -> dict:
    k = KINDS[kind]
    c = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 1,
        "hidden_size": hidden, "intermediate_size": 48, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": k["q_lora_rank"], "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "v_head_dim": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "rope_theta": 50000.0, "rope_scaling": k["rope_scaling"], "max_position_embeddings": 256,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True},
    }
    if k["draft_vocab_size"]:
        c["draft_vocab_size"] = k["draft_vocab_size"]
    for flag in ("fc_norm", "norm_output"):
        if k.get(flag):
            c[flag] = True
    return c


def write_mla_drafter(directory: Path, kind: str, vocab: int, hidden: int, aux_ids: list[int], seed: int = 0):
    """config.json + model.safetensors (bf16, TorchSpec's `layers.0.` names) -> {name: float32 tensor}, config."""
    c = mla_drafter_config(kind, vocab, hidden, aux_ids)
    g = torch.Generator().manual_seed(seed)
    h, n, f = hidden, c["num_attention_heads"], c["intermediate_size"]
    q, kc, dn, r, dv = c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    vd = c.get("draft_vocab_size", vocab)
    a = len(aux_ids)

    def lin(o, i):
        return (torch.randn(o, i, generator=g) / math.sqrt(i)).bfloat16()

    def norm(d):
        return (1.0 + 0.2 * torch.randn(d, generator=g)).bfloat16()

    m = "layers.0."
    t = {
        "fc.weight": lin(h, a * h),
        m + "input_layernorm.weight": norm(h), m + "hidden_norm.weight": norm(h),
        m + "post_attention_layernorm.weight": norm(h),
        m + "self_attn.q_a_proj.weight": lin(q, 2 * h), m + "self_attn.q_a_layernorm.weight": norm(q),
        m + "self_attn.q_b_proj.weight": lin(n * (dn + r), q),
        m + "self_attn.kv_a_proj_with_mqa.weight": lin(kc + r, 2 * h), m + "self_attn.kv_a_layernorm.weight": norm(kc),
        m + "self_attn.kv_b_proj.weight": lin(n * (dn + dv), kc), m + "self_attn.o_proj.weight": lin(h, n * dv),
        m + "mlp.gate_proj.weight": lin(f, h), m + "mlp.up_proj.weight": lin(f, h), m + "mlp.down_proj.weight": lin(h, f),
        "norm.weight": norm(h), "lm_head.weight": lin(vd, h),
        "embed_tokens.weight": torch.randn(vocab, h, generator=g).bfloat16(),
    }
    if c.get("fc_norm"):
        for i in range(a):
            t[f"fc_norm.{i}.weight"] = norm(h)
    if vd < vocab:
        target_ids = torch.sort(torch.randperm(vocab, generator=g)[:vd]).values
        t["d2t"] = (target_ids - torch.arange(vd)).to(torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        t["t2d"] = t2d
    directory.mkdir(parents=True, exist_ok=True)
    save_file(t, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(c, indent=1))
    return {k: (v.float() if v.is_floating_point() else v) for k, v in t.items()}, c


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _yarn_mscale(factor, m):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _inv_freq(c):
    """DeepSeek's YaRN inverse frequencies (or plain rope) over the rope slice, and the cos/sin multiplier."""
    d, base = c["qk_rope_head_dim"], c["rope_theta"]
    extra = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    y = c.get("rope_scaling")
    if not y:
        return extra, 1.0
    f, orig = y["factor"], y["original_max_position_embeddings"]

    def corr(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(corr(y["beta_fast"])), 0), min(math.ceil(corr(y["beta_slow"])), d - 1)
    hi = hi + 0.001 if lo == hi else hi
    extrapolate = 1 - ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    inv = extra / f * (1 - extrapolate) + extra * extrapolate
    return inv, _yarn_mscale(f, y["mscale"]) / _yarn_mscale(f, y["mscale_all_dim"])


def _rope_interleaved(x, pos, inv, mult):
    """x [B, T, .., R], pos [B, T]: pairs (x[2i], x[2i+1]) rotated by pos * inv[i] (DeepSeek's layout)."""
    ang = pos.double()[..., None] * inv  # [B, T, R/2]
    cos = (torch.cos(ang) * mult).float().repeat_interleave(2, -1)
    sin = (torch.sin(ang) * mult).float().repeat_interleave(2, -1)
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


class TorchMLADrafter:
    """The drafter in float32 PyTorch, with a per-position cache of expanded keys and values."""

    def __init__(self, t: dict, c: dict, batch: int, capacity: int):
        self.t, self.c = t, c
        n, dn, r, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.k_nope = torch.zeros(batch, capacity, n, dn)
        self.k_pe = torch.zeros(batch, capacity, r)
        self.v = torch.zeros(batch, capacity, n, dv)
        self.inv, self.mult = _inv_freq(c)
        y = c.get("rope_scaling")
        self.scale = (dn + r) ** -0.5 * (_yarn_mscale(y["factor"], y["mscale_all_dim"]) ** 2 if y else 1.0)

    def _attention(self, x, pos):
        t, c, m = self.t, self.c, "layers.0.self_attn."
        b, s, _ = x.shape
        n, dn, r, kc = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["kv_lora_rank"]
        eps = c["rms_norm_eps"]
        q = _rms(x @ t[m + "q_a_proj.weight"].T, t[m + "q_a_layernorm.weight"], eps) @ t[m + "q_b_proj.weight"].T
        q = q.view(b, s, n, dn + r)
        q_nope, q_pe = q[..., :dn], _rope_interleaved(q[..., dn:], pos, self.inv, self.mult)
        kv = x @ t[m + "kv_a_proj_with_mqa.weight"].T
        latent, k_pe = _rms(kv[..., :kc], t[m + "kv_a_layernorm.weight"], eps), kv[..., kc:]
        k_pe = _rope_interleaved(k_pe, pos, self.inv, self.mult)
        kvb = (latent @ t[m + "kv_b_proj.weight"].T).view(b, s, n, -1)
        rows = torch.arange(b)[:, None]
        self.k_nope[rows, pos] = kvb[..., :dn]
        self.v[rows, pos] = kvb[..., dn:]
        self.k_pe[rows, pos] = k_pe
        scores = torch.einsum("btnd,bsnd->bnts", q_nope, self.k_nope) + torch.einsum("btnr,bsr->bnts", q_pe, self.k_pe)
        visible = torch.arange(self.v.shape[1])[None, None, :] <= pos[:, :, None]  # [B, T, S]
        scores = (scores * self.scale).masked_fill(~visible[:, None], float("-inf"))
        out = torch.einsum("bnts,bsnv->btnv", torch.softmax(scores, -1), self.v)
        return out.reshape(b, s, -1) @ t[m + "o_proj.weight"].T

    def forward(self, tokens, h, pos):
        """tokens [B, T], h [B, T, A*H] (target aux states) or [B, T, H] (own output), pos [B, T]
        -> (logits [B, T, Vd], next h [B, T, H])."""
        t, c, m = self.t, self.c, "layers.0."
        eps, hid = c["rms_norm_eps"], c["hidden_size"]
        e = t["embed_tokens.weight"][tokens]
        if h.shape[-1] != hid:
            if c.get("fc_norm"):
                chunks = h.chunk(len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]), -1)
                h = torch.cat([_rms(ch, t[f"fc_norm.{i}.weight"], eps) for i, ch in enumerate(chunks)], -1)
            h = h @ t["fc.weight"].T
        residual = h
        x = torch.cat([_rms(e, t[m + "input_layernorm.weight"], eps), _rms(h, t[m + "hidden_norm.weight"], eps)], -1)
        residual = residual + self._attention(x, pos)
        y = _rms(residual, t[m + "post_attention_layernorm.weight"], eps)
        gate, up = y @ t[m + "mlp.gate_proj.weight"].T, y @ t[m + "mlp.up_proj.weight"].T
        out = residual + (torch.nn.functional.silu(gate) * up) @ t[m + "mlp.down_proj.weight"].T
        normed = _rms(out, t["norm.weight"], eps)
        return normed @ t["lm_head.weight"].T, (normed if c.get("norm_output") else out)
