"""The EAGLE-3 drafter (model/eagle3.py, fed by convert/) against an independent PyTorch LlamaForCausalLMEagle3
written here from the published definition (the SGLang / SpecForge drafter), on a drafter saved with
safetensors: float32 logits and hidden states agree to 1e-4.

The definition: h = fc(cat of the target's aux states) when h is 3H wide, else the draft's own previous output;
x = cat(input_layernorm(embed(token)), hidden_norm(h)) [2H]; one Llama layer over x (q/k/v from 2H, rotate-half
rope, grouped-query causal attention) whose residual stream starts at h; MLP down(silu(gate) * up); logits =
lm_head(norm(out)) over the draft vocabulary (target id = draft id + d2t); the next step's h is out (pre-norm).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from convert.checkpoint import load_draft
from convert.hf_draft_weights import load_hf_draft
from convert.stream import ConvertOptions, convert_checkpoint
from model.eagle3 import draft_forward, draft_to_target_ids, init_draft_cache
from model.sharding import make_mesh
from tests import convert_fixtures as fx

TOL = 1e-4


class TorchEagle3(torch.nn.Module):
    """LlamaForCausalLMEagle3 in float32, its parameters named as in the checkpoint."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.c = config
        self.w = {name: t.float() for name, t in tensors.items() if t.is_floating_point()}
        self.hot_ids = tensors["d2t"] + torch.arange(tensors["d2t"].shape[0])

    def _rms(self, x, name):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (x * torch.rsqrt(var + self.c["rms_norm_eps"]))

    def _rope(self, x_BNTD, pos_BT):
        d = x_BNTD.shape[-1]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = (pos_BT.double()[..., None] * inv).float()  # [B, T, D/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
        half = d // 2
        rotated = torch.cat([-x_BNTD[..., half:], x_BNTD[..., :half]], -1)
        return x_BNTD * cos + rotated * sin

    def forward(self, tokens_BT, h_BTX, pos_BT, past=None):
        """-> (draft-vocab logits [B, T, Vd], pre-norm output [B, T, H], (k, v) with the past)."""
        c, w, m = self.c, self.w, "midlayer."
        b, t = tokens_BT.shape
        n, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        emb = torch.nn.functional.embedding(tokens_BT, w["embed_tokens.weight"])
        h = h_BTX @ w["fc.weight"].T if h_BTX.shape[-1] != c["hidden_size"] else h_BTX
        x = torch.cat([self._rms(emb, m + "input_layernorm.weight"), self._rms(h, m + "hidden_norm.weight")], -1)
        q = (x @ w[m + "self_attn.q_proj.weight"].T).view(b, t, n, d).transpose(1, 2)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).view(b, t, nkv, d).transpose(1, 2)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).view(b, t, nkv, d).transpose(1, 2)
        q, k = self._rope(q, pos_BT), self._rope(k, pos_BT)
        key_pos = pos_BT
        if past is not None:
            k, v, key_pos = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2), torch.cat([past[2], pos_BT], 1)
        k_all, v_all = k.repeat_interleave(n // nkv, dim=1), v.repeat_interleave(n // nkv, dim=1)
        scores = q @ k_all.transpose(-1, -2) * d**-0.5  # [B, N, T, S]
        visible = key_pos[:, None, None, :] <= pos_BT[:, None, :, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        attn = (probs @ v_all).transpose(1, 2).reshape(b, t, n * d) @ w[m + "self_attn.o_proj.weight"].T
        resid = h + attn
        y = self._rms(resid, m + "post_attention_layernorm.weight")
        gate, up = y @ w[m + "mlp.gate_proj.weight"].T, y @ w[m + "mlp.up_proj.weight"].T
        out = resid + (torch.nn.functional.silu(gate) * up) @ w[m + "mlp.down_proj.weight"].T
        logits = self._rms(out, "norm.weight") @ w["lm_head.weight"].T
        return logits, out, (k, v, key_pos)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    src = root / "hf"
    src.mkdir()
    fx.drafter_checkpoint(src)  # bf16 tensors in safetensors, a LlamaForCausalLMEagle3 config.json
    config = json.loads((src / "config.json").read_text())
    torch_model = TorchEagle3(config, load_file(src / "model.safetensors"))
    dst = convert_checkpoint(src, root / "converted", ConvertOptions(dtype="float32", progress=False), lambda *_: None)
    return src, dst, torch_model


def _compare(cfg, w, torch_model):
    """Extend 7 positions from aux states, draft 2 steps on the draft's own output, extend 3 more; each stage
    attends to the earlier ones through the caches."""
    rng = np.random.default_rng(0)
    b, h = 2, cfg.hidden_size
    unused = jnp.zeros((cfg.vocab_size, h), jnp.float32)  # the drafter has its own embeddings and head
    fwd = jax.jit(draft_forward, static_argnames="cfg")
    cache, past = init_draft_cache(cfg, b, 16, jnp.float32), None
    start = np.zeros(b, np.int64)
    h_prev = None
    for stage, (t, wide) in enumerate([(7, True), (1, False), (1, False), (3, True)]):
        tokens = rng.integers(0, cfg.vocab_size, (b, t))
        h_in = rng.standard_normal((b, t, cfg.aux_width)).astype(np.float32) if wide else h_prev
        pos = start[:, None] + np.arange(t)[None]
        out = fwd(w, cfg, unused, unused, jnp.asarray(tokens), jnp.asarray(h_in), jnp.asarray(pos), cache)
        want_logits, want_hidden, past = torch_model(
            torch.from_numpy(tokens), torch.from_numpy(np.asarray(h_in)), torch.from_numpy(pos), past)
        for got, want in ((out.hidden, want_hidden), (out.logits, want_logits)):
            np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=TOL, rtol=0, err_msg=f"stage {stage}")
        cache, h_prev, start = out.cache, want_hidden[:, -1:].numpy(), start + t
    draft_ids = np.arange(cfg.draft_vocab_size)
    np.testing.assert_array_equal(np.asarray(draft_to_target_ids(w, jnp.asarray(draft_ids))), torch_model.hot_ids.numpy())


def test_converted_drafter_matches_torch(drafter):
    src, dst, torch_model = drafter
    cfg, w = load_draft(dst, make_mesh(), dtype=jnp.float32)
    _compare(cfg, w, torch_model)
    # the engine's direct HF loader yields the same weights (test_convert_parity checks every leaf; the config here)
    assert load_hf_draft(src, np.float32)[0] == cfg
