"""EAGLE-3 MLA drafters and EAGLE-3.1 (fc_norm, norm_output, YaRN): written in the published safetensors layout,
converted, held to an independent PyTorch forward through the draft cache over several cycles (float32, 1e-4), run
by the engine with greedy output equal to plain decoding, and lossless under sampling (chi-square)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from convert.check import check_conversion
from convert.checkpoint import load_draft
from convert.hf_config import draft_config_to_hf
from convert.stream import ConvertOptions, convert_checkpoint
from jaxspec.engine import Engine
from jaxspec.models import SpecConfig, SpecWeights, check_draft_fits
from jaxspec.sampling import SamplingParams
from model.attention_mla import fuse_input_projections
from model.eagle3 import DraftConfig, draft_config_from_dict, draft_forward, init_draft_cache
from tests.mla_drafters import TorchMLADrafter, write_mla_drafter
from tests.numpy_pair import numpy_draft, numpy_target
from tests.tiny_models import tiny_target_config

TOL = 1e-4
VOCAB = 64
# the two conventions of eagle_aux_hidden_state_layer_ids: boundaries (vLLM) and layer outputs; both mean 1, 2, 3
AUX_IDS = {"mla": [2, 3, 4], "mla31": [1, 2, 3]}


@pytest.fixture(scope="module", params=["mla", "mla31"])
def converted(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    tensors, raw = write_mla_drafter(root / "src", kind, VOCAB, 32, AUX_IDS[kind])
    dst = convert_checkpoint(root / "src", root / "dst", ConvertOptions(dtype="float32", progress=False), print)
    assert check_conversion(root / "src", dst, log=print) == 0
    cfg, w = load_draft(dst, dtype=jnp.float32)
    return kind, tensors, raw, cfg, w


def test_config_and_tensors(converted):
    kind, t, raw, cfg, w = converted
    assert cfg.attention == "mla" and cfg.aux_layer_ids == (1, 2, 3)
    assert (cfg.fc_norm, cfg.norm_output) == ((True, True) if kind == "mla31" else (False, False))
    assert cfg.rope_scaling is None if kind == "mla" else cfg.rope_scaling.factor == 8.0
    assert w.q_proj is None and w.mla is not None
    a = "layers.0.self_attn."
    np.testing.assert_array_equal(np.asarray(w.mla.q_a_proj), t[a + "q_a_proj.weight"].numpy())
    kv_b = t[a + "kv_b_proj.weight"].numpy().reshape(2, 16, 16)
    np.testing.assert_array_equal(np.asarray(w.mla.w_uk), kv_b[:, :8].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(w.mla.w_uv), kv_b[:, 8:])
    if kind == "mla31":
        np.testing.assert_array_equal(np.asarray(w.fc_norm[2]), t["fc_norm.2.weight"].numpy())
    else:
        assert w.fc_norm is None and w.d2t is not None
    assert draft_config_from_dict(draft_config_to_hf(cfg)) == cfg  # what jaxspec writes reads back the same


@pytest.mark.parametrize("fused", [False, True], ids=["as-converted", "fused-as-run"])
def test_forward_matches_torch_through_cycles(converted, fused):
    """Extend, draft ahead on the draft's own output, extend again over rejected slots, and once more: logits
    and the carried hidden state agree with the PyTorch reference at every step, with the weights as converted
    and with q_a and kv_a as one weight, as the engines run them."""
    kind, t, raw, cfg, w = converted
    if fused:
        w = w.replace(mla=fuse_input_projections(w.mla))
        assert w.mla.qkv_a_proj is not None
    b, cap, a = 2, 32, 3 * 32
    ref = TorchMLADrafter(t, raw, b, cap)
    cache = init_draft_cache(cfg, b, cap, jnp.float32)
    g = torch.Generator().manual_seed(1)
    dummy = jnp.zeros((1, 32), jnp.float32)
    step = jax.jit(lambda tok, h, pos, cache: draft_forward(w, cfg, dummy, dummy, tok, h, pos, cache))
    offset = torch.tensor([[0], [3]])  # the two rows sit at different positions

    def both(tokens, h, pos):
        nonlocal cache
        out = step(jnp.asarray(tokens.numpy()), jnp.asarray(h.numpy()), jnp.asarray(pos.numpy(), jnp.int32), cache)
        cache = out.cache
        logits, hidden = ref.forward(tokens, h, pos)
        np.testing.assert_allclose(np.asarray(out.logits), logits.numpy(), atol=TOL, rtol=TOL)
        np.testing.assert_allclose(np.asarray(out.hidden), hidden.numpy(), atol=TOL, rtol=TOL)
        return hidden

    def extend(start, n):
        pos = start + torch.arange(n)[None] + offset
        return both(torch.randint(0, VOCAB, (b, n), generator=g), torch.randn(b, n, a, generator=g), pos)

    for start, n, ahead in ((0, 6, 3), (6, 2, 2), (7, 4, 3)):  # each extend overwrites the slots drafted past it
        h = extend(start, n)[:, -1:]
        for j in range(ahead):
            pos = start + n + j + offset
            h = both(torch.randint(0, VOCAB, (b, 1), generator=g), h, pos)[:, -1:]


@pytest.fixture(scope="module")
def target():
    cfg = tiny_target_config(VOCAB, aux_layer_ids=(1, 2, 3), eos_token_id=())
    return cfg, numpy_target(cfg, seed=0)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]


def test_greedy_speculation_equals_plain_decoding(converted, target):
    kind, t, raw, dcfg, dw = converted
    tcfg, tw = target
    tcfg = check_draft_fits(tcfg, dcfg, dw)
    eng = Engine(SpecConfig(tcfg, dcfg), SpecWeights(tw, dw), num_steps=3)
    # plain decoding by the target alone: one program for both drafters
    plain = Engine(SpecConfig(tcfg, None), SpecWeights(tw, None), num_steps=0)
    assert eng.generate(PROMPTS, 16).tokens == plain.generate(PROMPTS, 16).tokens


def _joint_first3(eng, sampling, speculative, seed, n, vocab):
    res = eng.generate([[1, 2, 3]] * n, 3, sampling=sampling, seed=seed, speculative=speculative)
    toks = np.asarray(res.tokens)
    return toks[:, 0] * vocab * vocab + toks[:, 1] * vocab + toks[:, 2], res.stats


def test_sampling_with_an_mla_drafter_is_lossless():
    """The joint distribution of the first three sampled tokens is the target's (chi-square), with a small
    EAGLE-3.1 MLA drafter reading two aux layers, over a vocabulary small enough that drafts are often accepted."""
    vocab, n = 4, 3_000
    tcfg = tiny_target_config(vocab, num_hidden_layers=2, aux_layer_ids=(0, 1), eos_token_id=())
    dcfg = DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=12,
                       intermediate_size=32, vocab_size=vocab, draft_vocab_size=vocab, rope_theta=50000.0,
                       rms_norm_eps=1e-5, aux_layer_ids=(0, 1), attention="mla", q_lora_rank=None, kv_lora_rank=8,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope_scaling=tcfg.rope_scaling,
                       fc_norm=True, norm_output=True)
    weights = SpecWeights(numpy_target(tcfg, seed=3), numpy_draft(dcfg, seed=4))
    eng = Engine(SpecConfig(tcfg, dcfg), weights, num_steps=2)
    sampling = SamplingParams(1.0)
    spec, stats = _joint_first3(eng, sampling, True, 1, n, vocab)
    base, _ = _joint_first3(eng, sampling, False, 2, n, vocab)
    assert stats.mean_acceptance_length > 1.2  # drafts were accepted: the acceptance rule was exercised
    table = np.stack([np.bincount(spec, minlength=vocab**3), np.bincount(base, minlength=vocab**3)])
    assert chi2_contingency(table[:, table.sum(0) > 0])[1] > 1e-3


def test_aux_ids_conventions_and_errors():
    raw = draft_config_to_hf(dataclasses.replace(
        DraftConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=12, intermediate_size=32,
                    vocab_size=8, draft_vocab_size=8, rope_theta=1e4, rms_norm_eps=1e-5, aux_layer_ids=(1, 29, 57),
                    attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)))
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert draft_config_from_dict({**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
                                  ).aux_layer_ids == (1, 29, 57)
    assert draft_config_from_dict({**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5, 9, 30]}}
                                  ).aux_count == 4
    from model.config import ConfigError

    for bad, key in (({"mla_use_nope": True}, "mla_use_nope"), ({"use_moe": True}, "use_moe"),
                     ({"qk_rope_head_dim": 5}, "qk_rope_head_dim"), ({"kv_lora_rank": None}, "kv_lora_rank"),
                     ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures")):
        with pytest.raises(ConfigError, match=key):
            draft_config_from_dict({**raw, **bad})
