"""Hugging Face DeepseekV3 / Kimi tensor names -> jaxspec weight pytrees, one layer at a time.

Layouts: linear weights keep HF's [out, in]; q_b_proj, kv_b_proj and o_proj are split per head
([N, .., ..]) so heads can be sharded, kv_b_proj's k_nope rows stored [N, C, Dn] (`w_uk`: the absorbed
query contracts Dn along the minor axis); routed experts are stacked to [E, ..]. INT4 experts stay packed,
FP8 experts stay FP8 unless `dequantize_experts`; every other quantized tensor becomes `dtype`.
Everything is numpy on the host (no device memory is touched while converting).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from convert.dequantize_numpy import dequantize_fp8_block, dequantize_int4_group
from convert.kimi_tensors import layer_item, layer_prefix
from convert.safetensors_reader import CheckpointError
from model.attention_mla import MLAWeights
from model.config import TextConfig
from model.decoder import KimiWeights, LayerWeights
from model.mlp import MLPWeights
from model.moe import ExpertWeights, MoEWeights
from model.quant import Fp8Weight, Int4Weight

__all__ = ["TensorSource", "WeightBuilder", "layer_prefix", "load_kimi_weights"]


class TensorSource(Protocol):
    def has(self, name: str) -> bool: ...
    def get(self, name: str) -> np.ndarray: ...
    def shape(self, name: str) -> tuple[int, ...]: ...


class WeightBuilder:
    """Reads tensors by HF name, checks shapes against the config, dequantizes where asked."""

    def __init__(self, src: TensorSource, cfg: TextConfig, dtype=jnp.bfloat16, *, dequantize_experts=False):
        self.src, self.cfg, self.dtype = src, cfg, np.dtype(dtype)
        self.dequantize_experts = dequantize_experts
        self.used: set[str] = set()

    # --- raw access ---------------------------------------------------------------------------------
    def raw(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if not self.src.has(name):
            raise CheckpointError(f"missing tensor '{name}'")
        if shape is not None and tuple(self.src.shape(name)) != tuple(shape):
            raise CheckpointError(
                f"tensor '{name}' has shape {tuple(self.src.shape(name))}, config expects {tuple(shape)}"
            )
        self.used.add(name)
        return self.src.get(name)

    def dense(self, module: str, out: int, inp: int, dtype=None) -> np.ndarray:
        """A Linear's weight [out, in] as a dense array (FP8 / INT4 dequantized on the host)."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        q = self.quantized(module, out, inp)
        if isinstance(q, Int4Weight):
            return dequantize_int4_group(q.packed, q.scale).astype(dtype)
        if isinstance(q, Fp8Weight):
            return dequantize_fp8_block(q.weight, q.scale_inv, self.fp8_block).astype(dtype)
        return q.astype(dtype, copy=False)

    @property
    def fp8_block(self) -> tuple[int, int]:
        return tuple(self.cfg.quant.block_size) if self.cfg.quant else (128, 128)

    def quantized(self, module: str, out: int, inp: int):
        """A Linear's weight as stored: ndarray, Int4Weight or Fp8Weight (numpy-backed)."""
        if self.src.has(module + ".weight_packed"):
            return self._int4(module, out, inp)
        w = self.raw(module + ".weight", (out, inp))
        if self.src.has(module + ".weight_scale_inv"):
            if w.dtype != ml_dtypes.float8_e4m3fn:
                raise CheckpointError(f"tensor '{module}.weight' has dtype {w.dtype} but a weight_scale_inv (FP8 expects float8_e4m3fn)")
            bo, bi = self.fp8_block
            s = self.raw(module + ".weight_scale_inv", (-(-out // bo), -(-inp // bi)))
            return Fp8Weight(w, s.astype(np.float32, copy=False), (bo, bi))
        if w.dtype == ml_dtypes.float8_e4m3fn:
            raise CheckpointError(f"tensor '{module}.weight' is float8 but '{module}.weight_scale_inv' is missing")
        if w.dtype.kind not in "f" and w.dtype != ml_dtypes.bfloat16:
            raise CheckpointError(f"tensor '{module}.weight' has unsupported dtype {w.dtype}")
        return w

    def _int4(self, module: str, out: int, inp: int) -> Int4Weight:
        q = self.cfg.quant
        if q is None or q.method != "int4":
            raise CheckpointError(f"tensor '{module}.weight_packed' is INT4 but config.json declares no compressed-tensors quantization")
        if inp % 8 or inp % q.group_size:
            raise CheckpointError(f"tensor '{module}': input dim {inp} is not a multiple of 8 and group_size {q.group_size}")
        packed = self.raw(module + ".weight_packed", (out, inp // 8))
        if packed.dtype not in (np.int32, np.uint32):
            raise CheckpointError(f"tensor '{module}.weight_packed' has dtype {packed.dtype}, expected int32")
        scale = self.raw(module + ".weight_scale", (out, inp // q.group_size))
        if self.src.has(module + ".weight_shape"):
            ws = [int(v) for v in self.raw(module + ".weight_shape").reshape(-1)]
            if ws != [out, inp]:
                raise CheckpointError(f"tensor '{module}.weight_shape' says {ws}, config expects {[out, inp]}")
        return Int4Weight(packed.view(np.uint32), scale)

    def vector(self, name: str, n: int, dtype=None) -> np.ndarray:
        return self.raw(name, (n,)).astype(self.dtype if dtype is None else dtype, copy=False)

    # --- blocks -------------------------------------------------------------------------------------
    def mla(self, layer: int) -> MLAWeights:
        c, p = self.cfg, layer_prefix(self.cfg, layer) + "self_attn."
        h, n, dn, r, dv, kc = c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            q_a, q_norm = None, None
            q_b = self.dense(p + "q_proj", n * (dn + r), h).reshape(n, dn + r, h)
        else:
            q_a = self.dense(p + "q_a_proj", c.q_lora_rank, h)
            q_norm = self.vector(p + "q_a_layernorm.weight", c.q_lora_rank)
            q_b = self.dense(p + "q_b_proj", n * (dn + r), c.q_lora_rank).reshape(n, dn + r, c.q_lora_rank)
        kv_b = self.dense(p + "kv_b_proj", n * (dn + dv), kc).reshape(n, dn + dv, kc)
        return MLAWeights(
            q_a_proj=q_a, q_a_norm=q_norm, q_b_proj=q_b,
            kv_a_proj=self.dense(p + "kv_a_proj_with_mqa", kc + r, h),
            kv_a_norm=self.vector(p + "kv_a_layernorm.weight", kc),
            w_uk=np.ascontiguousarray(kv_b[:, :dn].transpose(0, 2, 1)), w_uv=np.ascontiguousarray(kv_b[:, dn:]),
            o_proj=self.dense(p + "o_proj", h, n * dv).reshape(h, n, dv),
        )

    def mlp(self, prefix: str, hidden: int, inter: int) -> MLPWeights:
        return MLPWeights(
            gate=self.dense(prefix + "gate_proj", inter, hidden),
            up=self.dense(prefix + "up_proj", inter, hidden),
            down=self.dense(prefix + "down_proj", hidden, inter),
        )

    def expert_matrix(self, module: str, out: int, inp: int):
        if self.dequantize_experts:
            return self.dense(module, out, inp)
        w = self.quantized(module, out, inp)
        return w if isinstance(w, (Int4Weight, Fp8Weight)) else w.astype(self.dtype, copy=False)

    def experts(self, layer: int) -> ExpertWeights:
        c, p = self.cfg, layer_prefix(self.cfg, layer) + "mlp.experts."
        h, f, n = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts

        def stack(proj: str, out: int, inp: int):
            # fill one preallocated [E, ..] buffer per component: a layer is held once, not twice
            first = self.expert_matrix(f"{p}0.{proj}", out, inp)
            stacked = jax.tree_util.tree_map(lambda x: np.empty((n, *x.shape), x.dtype), first)
            for e in range(n):
                m = first if e == 0 else self.expert_matrix(f"{p}{e}.{proj}", out, inp)
                if type(m) is not type(first):
                    raise CheckpointError(
                        f"layer {layer} experts mix storage formats ({type(first).__name__}, {type(m).__name__}) in {proj}"
                    )
                jax.tree_util.tree_map(lambda buf, x: buf.__setitem__(e, x), stacked, m)
            return stacked

        return ExpertWeights(gate=stack("gate_proj", f, h), up=stack("up_proj", f, h), down=stack("down_proj", h, f))

    def router(self, name: str) -> np.ndarray:
        """The router [E, H] in its stored float dtype (Kimi stores bf16): the logits are computed in float32 from it
        (`model.router.router_logits`), exact either way, and a widened copy would double its bytes every step.
        Anything narrower than 16 bits is widened to float32."""
        w = self.raw(name, (self.cfg.n_routed_experts, self.cfg.hidden_size))
        return w if w.dtype in (np.float32, np.float16, ml_dtypes.bfloat16) else w.astype(np.float32)

    def layer(self, layer: int) -> LayerWeights:
        c, p = self.cfg, layer_prefix(self.cfg, layer)
        if c.is_moe_layer(layer):
            ff = MoEWeights(
                router=self.router(p + "mlp.gate.weight"),
                router_bias=self.vector(p + "mlp.gate.e_score_correction_bias", c.n_routed_experts, np.float32),
                experts=self.experts(layer),
                shared=None if c.n_shared_experts == 0 else self.mlp(
                    p + "mlp.shared_experts.", c.hidden_size, c.moe_intermediate_size * c.n_shared_experts
                ),
            )
        else:
            ff = self.mlp(p + "mlp.", c.hidden_size, c.intermediate_size)
        return LayerWeights(
            input_norm=self.vector(p + "input_layernorm.weight", c.hidden_size),
            post_attention_norm=self.vector(p + "post_attention_layernorm.weight", c.hidden_size),
            attn=self.mla(layer),
            mlp=ff,
        )

    def embed(self) -> np.ndarray:
        c = self.cfg
        name = f"{c.weight_prefix}model.embed_tokens.weight"
        return self.raw(name, (c.vocab_size, c.hidden_size)).astype(self.dtype, copy=False)

    def final_norm(self) -> np.ndarray:
        return self.vector(f"{self.cfg.weight_prefix}model.norm.weight", self.cfg.hidden_size)

    def lm_head(self) -> np.ndarray:
        c = self.cfg
        return self.dense(f"{c.weight_prefix}lm_head", c.vocab_size, c.hidden_size)

    def item(self, name: str):
        """One conversion item (see kimi_tensors.target_items): "embed", "layer_NNN" or "head"."""
        if name == "embed":
            return self.embed()
        if name == "head":
            return {"final_norm": self.final_norm(), "lm_head": self.lm_head()}
        for i in range(self.cfg.num_hidden_layers):
            if name == layer_item(i):
                return self.layer(i)
        raise KeyError(f"no conversion item {name!r}")


def load_kimi_weights(src: TensorSource, cfg: TextConfig, dtype=jnp.bfloat16, **kw) -> KimiWeights:
    """Whole-model load into memory (tests and small models; `python -m convert` streams instead)."""
    b = WeightBuilder(src, cfg, dtype, **kw)
    w = KimiWeights(
        embed=b.embed(),
        layers=tuple(b.layer(i) for i in range(cfg.num_hidden_layers)),
        final_norm=b.final_norm(),
        lm_head=b.lm_head(),
    )
    return jax.tree_util.tree_map(jnp.asarray, w)
