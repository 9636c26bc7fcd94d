"""Tiny source checkpoints for the converter tests, written by the real writers.

- bf16: HF DeepseekV3ForCausalLM.save_pretrained of a bf16 model;
- FP8 block: torch.float8_e4m3fn weights + float32 `weight_scale_inv` (ceil-div block grid), safetensors.torch;
- INT4: compressed-tensors' own `pack_to_int32`, with K2-Thinking's exact quantization_config;
- K2.5: the INT4 one inside `text_config`, tensors under `language_model.`, plus vision tensors;
- EAGLE-3 drafter: safetensors.torch.save_file and a LlamaForCausalLMEagle3 config.

Each quantized writer also returns a float32 HF model holding exactly the dequantized weights (loaded
with from_pretrained), which is the reference for logits.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.hf_tiny import make_hf_model

REPO = Path(__file__).resolve().parents[1]

# 8 heads, 16 experts, vocab 96: divisible by the 8 simulated devices, so heads, experts and vocab really shard
CONVERT_TINY = dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8)


def k2_thinking_quantization_config() -> dict:
    return json.loads((REPO / "model/configs/kimi-k2-thinking.json").read_text())["quantization_config"]


def k25_quantization_config() -> dict:
    return json.loads((REPO / "model/configs/kimi-k2.5.json").read_text())["text_config"]["quantization_config"]


def write_tokenizer_files(directory: Path) -> list[str]:
    files = {
        "tiktoken.model": "dGVzdA== 0\n",
        "tokenizer_config.json": json.dumps({"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]"}),
        "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    for name, text in files.items():
        (directory / name).write_text(text)
    return sorted(files)


def round_model_to_bf16_(model) -> None:
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                t.copy_(t.bfloat16().float())


def bf16_checkpoint(directory: Path, seed: int = 0, **overrides):
    """save_pretrained of a bf16 model; -> the float32 model with the same (bf16-exact) weights."""
    model = make_hf_model(seed, **{**CONVERT_TINY, **overrides})
    round_model_to_bf16_(model)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    write_tokenizer_files(directory)
    return model


def _on_disk_float32(model, scratch: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """HF's own on-disk names (experts unfused) and config.json, via save_pretrained."""
    model.save_pretrained(scratch, safe_serialization=True)
    tensors = {}
    for f in sorted(scratch.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors, json.loads((scratch / "config.json").read_text())


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]):
    """-> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/bo), ceil(in/bi)], dequantized float32)."""
    out, inp = w.shape
    bo, bi = block
    go, gi = math.ceil(out / bo), math.ceil(inp / bi)
    padded = torch.zeros(go * bo, gi * bi)
    padded[:out, :inp] = w
    amax = padded.reshape(go, bo, gi, bi).abs().amax(dim=(1, 3)).clamp(min=1e-8)
    scale = (amax / 448.0).float()
    full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inp]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def int4_group_quantize(w: torch.Tensor, group: int):
    """Symmetric INT4 per group of `group` inputs, packed by compressed-tensors.
    -> (int32 packed [out, in/8], bf16 scale [out, in/group], dequantized float32)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    scale = (g.abs().amax(-1) / 7.0).clamp(min=1e-8).bfloat16()
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -8, 7).to(torch.int8)
    deq = (q.float() * scale.float()[..., None]).reshape(out, inp)
    return pack_to_int32(q.reshape(out, inp), 4), scale, deq


def write_shards(tensors: dict[str, torch.Tensor], directory: Path, n_shards: int = 3) -> None:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, consecutive names per shard."""
    names = sorted(tensors)
    per = math.ceil(len(names) / n_shards)
    weight_map = {}
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        chunk = {n: tensors[n].contiguous() for n in names[i * per:(i + 1) * per]}
        save_file(chunk, directory / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


def _reference_model(dequantized: dict[str, torch.Tensor], config: dict, scratch: Path):
    """A float32 DeepseekV3ForCausalLM holding exactly the dequantized weights (HF fuses the experts)."""
    from transformers import DeepseekV3ForCausalLM

    scratch.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in dequantized.items()}, scratch / "model.safetensors", metadata={"format": "pt"})
    (scratch / "config.json").write_text(json.dumps(config))
    return DeepseekV3ForCausalLM.from_pretrained(scratch, dtype=torch.float32).eval()


LINEAR_WEIGHT = re.compile(r"(_proj|_proj_with_mqa)\.weight$")
EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _stored_bf16(t: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(on-disk tensor, its exact float32 value): bf16, except the router bias which K2 keeps in float32."""
    if name.endswith("e_score_correction_bias"):
        return t.float(), t.float()
    b = t.bfloat16()
    return b, b.float()


def fp8_checkpoint(directory: Path, scratch: Path, block=(16, 16), seed: int = 1, **overrides):
    """K2-Instruct style: every Linear but the router and lm_head in FP8 blocks."""
    model = make_hf_model(seed, **{**CONVERT_TINY, **overrides})
    tensors, config = _on_disk_float32(model, scratch / "f32")
    stored, deq = {}, {}
    for name, t in tensors.items():
        if LINEAR_WEIGHT.search(name):
            q, s, d = fp8_block_quantize(t.float(), block)
            stored[name], stored[name + "_scale_inv"], deq[name] = q, s, d
        else:
            stored[name], deq[name] = _stored_bf16(t, name)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    write_shards(stored, directory)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer_files(directory)
    ref_config = {k: v for k, v in config.items() if k != "quantization_config"}
    return _reference_model(deq, ref_config, scratch / "ref")


def _int4_tensors(tensors: dict[str, torch.Tensor], group: int):
    stored, deq = {}, {}
    for name, t in tensors.items():
        if EXPERT_WEIGHT.search(name):
            module = name.removesuffix(".weight")
            packed, scale, d = int4_group_quantize(t.float(), group)
            stored[module + ".weight_packed"] = packed
            stored[module + ".weight_scale"] = scale
            stored[module + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            deq[name] = d
        else:
            stored[name], deq[name] = _stored_bf16(t, name)
    return stored, deq


def int4_checkpoint(directory: Path, scratch: Path, seed: int = 2, **overrides):
    """K2-Thinking style: routed experts INT4 pack-quantized (group 32), everything else bf16."""
    model = make_hf_model(seed, **{**CONVERT_TINY, **overrides})
    tensors, config = _on_disk_float32(model, scratch / "f32")
    qc = k2_thinking_quantization_config()
    stored, deq = _int4_tensors(tensors, qc["config_groups"]["group_0"]["weights"]["group_size"])
    config["quantization_config"] = qc
    write_shards(stored, directory)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer_files(directory)
    return _reference_model(deq, {k: v for k, v in config.items() if k != "quantization_config"}, scratch / "ref")


def k25_checkpoint(directory: Path, scratch: Path, seed: int = 3, **overrides):
    """Kimi-K2.5 layout: multimodal wrapper config, `language_model.` tensors, vision tensors to skip."""
    model = make_hf_model(seed, **{**CONVERT_TINY, **overrides})
    tensors, text_config = _on_disk_float32(model, scratch / "f32")
    qc = k25_quantization_config()
    stored, deq = _int4_tensors(tensors, qc["config_groups"]["group_0"]["weights"]["group_size"])
    stored = {"language_model." + k: v for k, v in stored.items()}
    stored["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2).bfloat16()
    stored["mm_projector.proj.0.weight"] = torch.randn(64, 32).bfloat16()
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {**text_config, "quantization_config": qc},
        "vision_config": {"model_type": "moonvit", "hidden_size": 32},
        "bos_token_id": text_config.get("bos_token_id"),
        "eos_token_id": text_config.get("eos_token_id"),
    }
    write_shards(stored, directory, n_shards=4)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer_files(directory)
    return _reference_model(deq, text_config, scratch / "ref")


DRAFT_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                  vocab_size=96, draft_vocab_size=32, rope_theta=1e6, rms_norm_eps=1e-6)


def drafter_checkpoint(directory: Path, seed: int = 4, with_embed: bool = True) -> dict[str, np.ndarray]:
    """An EAGLE-3 drafter (bf16 weights, int64 d2t, bool t2d); -> its tensors as float64 / int64 numpy."""
    c = DRAFT_TINY
    h, n, kv, d, f = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]
    v, vd = c["vocab_size"], c["draft_vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def lin(out, inp):
        return (torch.randn(out, inp, generator=g) * inp**-0.5).bfloat16()

    def norm(k):
        return (1.0 + 0.1 * torch.randn(k, generator=g)).bfloat16()

    m = "midlayer."
    tensors = {
        "fc.weight": lin(h, 3 * h),
        m + "input_layernorm.weight": norm(h), m + "hidden_norm.weight": norm(h),
        m + "post_attention_layernorm.weight": norm(h),
        m + "self_attn.q_proj.weight": lin(n * d, 2 * h), m + "self_attn.k_proj.weight": lin(kv * d, 2 * h),
        m + "self_attn.v_proj.weight": lin(kv * d, 2 * h), m + "self_attn.o_proj.weight": lin(h, n * d),
        m + "mlp.gate_proj.weight": lin(f, h), m + "mlp.up_proj.weight": lin(f, h), m + "mlp.down_proj.weight": lin(h, f),
        "norm.weight": norm(h),
        "lm_head.weight": lin(vd, h),
    }
    target_ids = torch.sort(torch.randperm(v, generator=g)[:vd]).values
    tensors["d2t"] = (target_ids - torch.arange(vd)).to(torch.int64)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[target_ids] = True
    tensors["t2d"] = t2d
    if with_embed:
        tensors["embed_tokens.weight"] = torch.randn(v, h, generator=g).bfloat16()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_act": "silu", "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
        **c,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer_files(directory)
    return {k: (t.double().numpy() if t.is_floating_point() else t.numpy()) for k, t in tensors.items()}


def synthetic_checkpoint(directory: Path, seed: int = 0, **overrides) -> dict:
    """Random bf16 tensors under every name the converter expects, one shard per layer (for size, not
    numerics: HF-written names are covered by the writers above). -> the config dict."""
    from convert.kimi_tensors import LinearSpec, target_items
    from model.config import text_config_from_dict
    from tests.hf_tiny import tiny_config_dict

    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", **tiny_config_dict(**overrides)}
    cfg = text_config_from_dict(config)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for item, specs in target_items(cfg).items():
        tensors = {}
        for s in specs:
            name, shape = (s.module + ".weight", (s.out, s.inp)) if isinstance(s, LinearSpec) else (s.name, s.shape)
            # random bf16 bit patterns with a sane exponent: cheap to make, incompressible like real weights
            bits = rng.integers(0x3C00, 0x3F80, size=shape, dtype=np.uint16) | (rng.integers(0, 2, size=shape, dtype=np.uint16) << 15)
            tensors[name] = torch.from_numpy(bits).view(torch.bfloat16)
        fname = f"{item}.safetensors"
        save_file(tensors, directory / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return config
