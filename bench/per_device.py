"""`python -m bench.per_device`: one device's program of the engine's N-way mesh (`--shard-of 8`: the 1 x 8 mesh that
`python -m jaxspec.serve --mesh 8` builds), at the local shapes the sharded engine gives one device, run on ONE device
with the mesh's collectives cut out and counted (issue 52).

    python -m bench.per_device --layers 61 --moe-layers repeated        # one H200
    python -m bench.per_device --tiny --layers 3 --out /tmp/pd          # a CPU smoke run

What one device runs:
- shapes: every weight, cache and state leaf at the shard shape model/sharding.py's rules give it on an abstract
  1 x N mesh (`local_shapes`): 1/N of the heads of q_b / w_uk / w_uv / o_proj, of the shared expert's and the dense
  MLP's FFN, of the embed and lm_head rows, E/N of the routed experts; the router, the attention input projections,
  the norms, the MLA latent cache and the EAGLE-3 draft whole. Weights are drawn at those shapes (the full model
  never exists here); caches and states are built whole and cut to device 0's block;
- routed experts as the engine's shard_map body runs them (model/moe_parallel.py): the router over all E experts,
  then `model.moe.routed_experts` over the E/N local experts from the global choices (other devices' choices
  skipped by moe_wgmma itself, or given weight 0 by `local_choices` on the other paths).
  Each MoE layer plays the device that received the most (token, choice) pairs in that layer: a step waits at
  every layer's all-reduce for the busiest device;
- kernels as the sharded engine dispatches them: the same as one device running these local shapes alone (the
  engine runs its MLA, router and routed-experts kernels per device inside shard_map, model/shard_local.py);
- collectives: each one the sharded program runs is cut where it sits (`CollectiveCuts.cut_collective`) and
  recorded by kind. The value passes unchanged through an optimisation barrier, which keeps the kernel boundary the
  collective draws (XLA cannot fuse across it; on a GPU the barrier is removed after fusion and costs no launch).
  tests/test_per_device.py holds the local shapes and the counts to the engine's compiled sharded programs on 8 CPU
  devices.

Rows: decode (T = 1) and verify (T = 2..5) steps, each at `--layers` N and at `--prefix-layers` M (the first M
layers of the same arrays); cycles K = 1..4 (the draft, the verify of K + 1, acceptance and the draft's extend, as
jaxspec.spec_step runs them). Routing: the experts the model's router chose in a first step of the same tokens
(`step_probe`), or bench.routes' neighbour regime, set in every timed step (each layer's busiest device then stays
its busiest). Times are per step inside one jitted device loop (bench.timing.device_loop_ms: medians of
synchronised calls after warm-up). `layer_us` = (N-layer step - M-layer step) / (N - M); `kernels_per_layer` = the launches of
the optimised programs (`kernel_launches`), the same difference; the floor = the bytes this device reads
(bench.bytes_floor.step_bytes over the local arrays, routed experts counted as the distinct local experts its slots
ran) / 4.3 TB/s. Writes per-device-<device>-<date>.json and .md to --out.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gzip  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AbstractMesh  # noqa: E402

from bench.bytes_floor import HBM_TBS, draft_bytes, floor_ms, step_bytes  # noqa: E402
from bench.cycle import MAX_NEW_TOKENS, initial_state, spec_pair  # noqa: E402
from bench.report import fmt, own_stem, publish, run_stamp  # noqa: E402
from bench.step import KERNEL_PATH_MOE, bench_config, random_cache, step_inputs, step_routes  # noqa: E402
from bench.timing import device_loop_ms  # noqa: E402
from jaxspec.models import SpecConfig, SpecWeights  # noqa: E402
from jaxspec.sharded import compile_programs  # noqa: E402
from jaxspec.spec_step import commit, draft_chain  # noqa: E402
from jaxspec.state import SpecState  # noqa: E402
from model.attention_mla import mla  # noqa: E402
from model.config import Kernels  # noqa: E402
from model.decoder import KimiWeights, LayerWeights, fuse_attention_inputs  # noqa: E402
from model.eagle3 import draft_forward  # noqa: E402
from model.init import init_kimi_weights  # noqa: E402
from model.kv_cache import round_capacity  # noqa: E402
from model.mlp import swiglu  # noqa: E402
from model.moe import MoEWeights, routed_experts  # noqa: E402
from model.norms import rms_norm  # noqa: E402
from model.rope import cos_sin, target_rope_tables  # noqa: E402
from model.router import route  # noqa: E402
from model.sharding import (CACHE_RULES, DRAFT_RULES, MESH_AXES, STATE_RULES, TARGET_RULES, path_str,  # noqa: E402
                            shard_shape, specs_for)

SHARD_OF = 8
ALL_REDUCE, ALL_GATHER = "all-reduce", "all-gather"
ROUTINGS = ("model", "neighbour")
# every dimension the rules split divides by 8, so the tiny model is split where Kimi-K2.5 is (bench.step's tiny
# dims have 4 heads, which the rules leave whole on 8 devices)
TINY_DIMS = dict(hidden_size=256, num_attention_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, intermediate_size=512, moe_intermediate_size=64,
                 n_routed_experts=16, num_experts_per_tok=4, vocab_size=1024)
# the program plays device 0's rows of the embed and lm_head (every device's share is the same size)
VOCAB_FIRST_ROW = 0


def per_device_config(layers: int, tiny: bool):
    """bench.step's Kimi-K2.5 config of `layers` layers (its tiny dims replaced by ones that divide by 8)."""
    cfg = bench_config(layers, tiny=False)
    return cfg.replace(**TINY_DIMS) if tiny else cfg


# --- local shapes ---------------------------------------------------------------------------------------------
def abstract_mesh(shard_of: int) -> AbstractMesh:
    return AbstractMesh((1, shard_of), MESH_AXES)


def local_shapes(tree, rules, shard_of: int):
    """`tree` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs of one device's shard on a 1 x `shard_of` mesh:
    `rules` through `specs_for`, as the engine's placement (jaxspec.sharded) and the planner read them."""
    mesh = abstract_mesh(shard_of)
    specs = specs_for(tree, mesh, rules)
    # `specs` is flattened up to `tree`'s leaves: each PartitionSpec stays whole
    return jax.tree_util.tree_map(
        lambda leaf, spec: jax.ShapeDtypeStruct(shard_shape(spec, tuple(leaf.shape), mesh), leaf.dtype), tree, specs)


def local_block(tree, rules, shard_of: int):
    """Device 0's block of each leaf of `tree` (whole where the rules keep a leaf whole)."""
    shapes = local_shapes(tree, rules, shard_of)
    return jax.tree_util.tree_map(lambda x, s: x[tuple(slice(0, n) for n in s.shape)], tree, shapes)


def _random_leaf(path: str, shape, dtype, source):
    """Random values of the kind each weight holds (magnitudes that keep 61 layers finite); `source` is a numpy
    Generator (host arrays: nothing to compile on a CPU) or a JAX key (drawn on the device)."""
    host = isinstance(source, np.random.Generator)
    normal = (lambda: source.standard_normal(shape, np.float32)) if host else (
        lambda: jax.random.normal(source, shape, jnp.float32))
    if jnp.dtype(dtype) == jnp.uint32:  # packed INT4 words
        return source.integers(0, 2**32, shape, dtype=np.uint32) if host else jax.random.bits(source, shape, jnp.uint32)
    if path.endswith(".scale"):  # INT4 group scales (groups of 32): unit fan-in variance, as model.init draws them
        value = np.full(shape, (shape[-1] * 32) ** -0.5 / 4.6, np.float32)
    elif path.endswith("norm"):
        value = 1.0 + 0.1 * normal()
    elif path.endswith("router_bias"):
        value = 0.01 * normal()
    elif path.endswith("embed"):
        value = normal()
    else:  # matrices: unit variance over the contracted (last) dim
        value = normal() * shape[-1] ** -0.5
    return np.asarray(value).astype(dtype) if host else jnp.asarray(value).astype(dtype)


def draw_like(shapes, source):
    """Random arrays at `shapes` (a pytree of ShapeDtypeStructs), on the default device."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    host = isinstance(source, np.random.Generator)
    keys = [None] * len(flat) if host else list(jax.random.split(source, len(flat)))
    leaves = [jnp.asarray(_random_leaf(path_str(p), s.shape, s.dtype, source if host else k))
              for (p, s), k in zip(flat, keys)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def local_weight_shapes(cfg, shard_of: int):
    """The target's weights as one device of a 1 x `shard_of` mesh holds them (INT4 routed experts, bf16 elsewhere),
    before the attention inputs are fused."""
    whole = jax.eval_shape(lambda k: init_kimi_weights(cfg, k, jnp.bfloat16, experts="int4"), jax.random.key(0))
    return local_shapes(whole, TARGET_RULES, shard_of)


def local_weights(cfg, shard_of: int, tiny: bool, moe_layers: str = "repeated", seed: int = 0) -> KimiWeights:
    """Random weights at one device's shapes (`local_weight_shapes`), the attention inputs fused as the engine runs
    them (jaxspec.sharded.weights_to_run). `moe_layers="repeated"`: the dense layers, then one MoE layer's arrays run
    by every MoE layer (a fraction of the drawing time; each layer still reads its own bytes from memory)."""
    shapes = local_weight_shapes(cfg, shard_of)
    source = (lambda i: np.random.default_rng(seed + i)) if tiny else (lambda i: jax.random.PRNGKey(seed + i))
    first_moe = cfg.first_k_dense_replace
    n = len(shapes.layers)
    drawn = n if moe_layers == "distinct" else min(n, first_moe + 1)
    layers = [draw_like(shapes.layers[i], source(i)) for i in range(drawn)]
    layers = list(fuse_attention_inputs(KimiWeights(None, tuple(layers), None, None)).layers)
    layers += [layers[-1]] * (n - drawn)
    top = draw_like(dict(embed=shapes.embed, final_norm=shapes.final_norm, lm_head=shapes.lm_head), source(n))
    return jax.block_until_ready(KimiWeights(layers=tuple(layers), **top))


def local_weight_bytes(cfg, shard_of: int) -> int:
    """Bytes one device holds of the target's weights, every layer its own (as the engine loads them)."""
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
               for s in jax.tree_util.tree_leaves(local_weight_shapes(cfg, shard_of)))


# --- the cut collectives --------------------------------------------------------------------------------------
class CollectiveCuts:
    """The collectives a traced program would run on the mesh, in trace order: (kind, where)."""

    def __init__(self):
        self.sites: list[tuple[str, str]] = []

    def cut_collective(self, x, kind: str, where: str):
        """`x` unchanged where the sharded program runs a collective of `kind`; recorded. The barrier keeps the
        boundary the collective draws between the kernels before and after it."""
        self.sites.append((kind, where))
        return jax.lax.optimization_barrier(x)

    def by_kind(self) -> dict[str, int]:
        return dict(Counter(kind for kind, _ in self.sites))


@dataclasses.dataclass(frozen=True)
class VocabShardRows:
    """One device's rows [V/N, H] of a table split over the vocabulary, indexed by token ids as the whole table:
    GSPMD gathers the rows this device holds, zeroes the others and all-reduces the sum, which is cut here."""

    rows_VH: jax.Array
    first_row: int
    cuts: CollectiveCuts
    where: str

    def __getitem__(self, tokens_BT):
        local_BT = tokens_BT - self.first_row
        mine_BT = (local_BT >= 0) & (local_BT < self.rows_VH.shape[0])
        rows_BTH = jnp.where(mine_BT[..., None], self.rows_VH[jnp.clip(local_BT, 0, self.rows_VH.shape[0] - 1)], 0)
        return self.cuts.cut_collective(rows_BTH.astype(self.rows_VH.dtype), ALL_REDUCE, self.where)


def embedding_table(embed_VH, vocab_size: int, cuts: CollectiveCuts, where: str):
    """The token-indexed table a device reads embeddings from: its vocab shard, or the whole table when unsplit."""
    if embed_VH.shape[0] == vocab_size:
        return embed_VH
    return VocabShardRows(embed_VH, VOCAB_FIRST_ROW, cuts, where)


def greedy_tokens(logits_BTV, vocab_size: int, cuts: CollectiveCuts):
    """The argmax over the vocabulary from this device's logits: over vocab shards the engine gathers each device's
    best logit and its token id (two all-gathers) and picks among them (a pick one device does not have to make)."""
    idx_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    if logits_BTV.shape[-1] == vocab_size:
        return idx_BT
    best_BT = jnp.max(logits_BTV, axis=-1)
    cuts.cut_collective(best_BT, ALL_GATHER, "argmax over vocab shards: each device's best logit")
    idx_BT = cuts.cut_collective(idx_BT, ALL_GATHER, "argmax over vocab shards: its token id")
    return idx_BT + VOCAB_FIRST_ROW


# --- one device's forward -------------------------------------------------------------------------------------
def device_moe(x_BTH, w: MoEWeights, cfg, first_expert, forced_TK, cuts: CollectiveCuts):
    """The MoE block on one device: (output [B, T, H], the experts each token chose [B*T, K], global ids)."""
    b, t, h = x_BTH.shape
    x_TH = x_BTH.reshape(b * t, h)
    weights_TK, ids_TK = route(x_TH, w.router, w.router_bias, cfg)  # the router is whole on every device
    if forced_TK is not None:
        # as if this layer's router had chosen them: replayed ids are the same every step, and XLA would hoist what
        # the engine derives from its router's ids every step (a device's local choices) out of the device loop
        ids_TK = jax.lax.optimization_barrier((forced_TK.astype(ids_TK.dtype), weights_TK))[0]
    n = w.experts.num_experts
    partial = []  # the partial sums the engine adds up over the devices
    if n < cfg.n_routed_experts:
        y_TH = routed_experts(x_TH, w.experts, ids_TK, weights_TK, cfg.kernels, first_expert=first_expert)
        partial.append("routed experts (psum)")
    else:
        y_TH = routed_experts(x_TH, w.experts, ids_TK, weights_TK, cfg.kernels)
    shared_TH = None
    if w.shared is not None:
        shared_TH = swiglu(x_TH, w.shared)
        if w.shared.gate.shape[0] < cfg.moe_intermediate_size * cfg.n_shared_experts:
            partial.append("shared expert down (FFN split)")
    if partial:
        # the routed experts' psum and the shared expert's all-reduce are independent: XLA combines them into one
        # (tests/test_per_device.py holds the count to the engine's compiled program)
        y_TH, shared_TH = cuts.cut_collective((y_TH, shared_TH), ALL_REDUCE, " + ".join(partial))
    if shared_TH is not None:
        y_TH = y_TH + shared_TH
    return y_TH.reshape(b, t, h), ids_TK


def device_layer(x_BTH, lw: LayerWeights, cos, sin, positions_BT, latent, k_rope, first_expert, forced_TK, *, cfg,
                 attention: str, cuts: CollectiveCuts):
    """model.decoder.decoder_layer as one device of the mesh runs it, its collectives cut."""
    attn_BTH, latent, k_rope = mla(rms_norm(x_BTH, lw.input_norm, cfg.rms_norm_eps), lw.attn, cfg, cos, sin,
                                   positions_BT, latent, k_rope, attention)
    if lw.attn.o_proj.shape[1] < cfg.num_attention_heads:  # o_proj over this device's heads: a partial sum
        attn_BTH = cuts.cut_collective(attn_BTH, ALL_REDUCE, "attention output (o_proj, heads split)")
    x_BTH = x_BTH + attn_BTH
    h_BTH = rms_norm(x_BTH, lw.post_attention_norm, cfg.rms_norm_eps)
    if isinstance(lw.mlp, MoEWeights):
        ff_BTH, ids_TK = device_moe(h_BTH, lw.mlp, cfg, first_expert, forced_TK, cuts)
    else:
        ff_BTH, ids_TK = swiglu(h_BTH, lw.mlp), None
        if lw.mlp.gate.shape[0] < cfg.intermediate_size:
            ff_BTH = cuts.cut_collective(ff_BTH, ALL_REDUCE, "dense MLP down (FFN split)")
    return x_BTH + ff_BTH, latent, k_rope, ids_TK


class TracedLayer:
    """One jitted `device_layer` for a kind of layer, traced once and called by every layer of that kind (as
    model.decoder.layer_call: tracing and lowering cost the same at 61 layers as at 2). `cuts` holds the collectives
    of its latest trace, which every call of it runs."""

    def __init__(self, cfg, attention: str):
        self.cuts = CollectiveCuts()

        def traced(*args):
            self.cuts.sites.clear()  # a (re)trace records the layer's collectives afresh
            return device_layer(*args, cfg=cfg, attention=attention, cuts=self.cuts)

        self.call = jax.jit(traced)


class DeviceForward(NamedTuple):
    tokens_BT: jax.Array  # [B, T] int32: the greedy target token at each position
    aux_hidden: jax.Array  # [B, T, len(aux layers) * H]
    cache: object  # LatentCache
    expert_ids: tuple[jax.Array, ...]  # per MoE layer [B*T, K]: global ids of the experts each token chose


def device_forward(w: KimiWeights, cfg, tokens_BT, positions_BT, cache, first_expert_L, cuts: CollectiveCuts, *,
                   expert_ids=None, attention: str = "absorbed") -> DeviceForward:
    """model.decoder.forward as one device runs it, with the greedy token choice the engine makes after it.
    `first_expert_L` [MoE layers] (or one scalar per MoE layer): the first global expert id of the device each MoE
    layer plays; `expert_ids` [MoE layers, B*T, K] (or one [B*T, K] per MoE layer) replaces the router's choices,
    as model.moe.moe's does."""
    inv_freq, multiplier = target_rope_tables(cfg)
    cos, sin = cos_sin(positions_BT, inv_freq, multiplier)
    table = embedding_table(w.embed, cfg.vocab_size, cuts, "embedding rows (embed split over the vocabulary)")
    x_BTH = table[tokens_BT]
    traced = {}
    aux_ids = set(cfg.eagle_aux_layers)
    aux, latents, k_ropes, chosen = [], [], [], []
    for i, lw in enumerate(w.layers):
        is_moe = isinstance(lw.mlp, MoEWeights)
        if is_moe not in traced:
            traced[is_moe] = TracedLayer(cfg, attention)
        layer = traced[is_moe]
        first = first_expert_L[len(chosen)] if is_moe else jnp.int32(0)
        forced_TK = expert_ids[len(chosen)] if (is_moe and expert_ids is not None) else None
        x_BTH, latent, k_rope, ids_TK = layer.call(x_BTH, lw, cos, sin, positions_BT, cache.latent[i], cache.k_rope[i],
                                                   first, forced_TK)
        cuts.sites.extend(layer.cuts.sites)
        latents.append(latent)
        k_ropes.append(k_rope)
        if ids_TK is not None:
            chosen.append(ids_TK)
        if i in aux_ids:
            aux.append(x_BTH)
    final_BTH = rms_norm(x_BTH, w.final_norm, cfg.rms_norm_eps)
    logits_BTV = jnp.einsum("bth,vh->btv", final_BTH, w.lm_head.astype(final_BTH.dtype),
                            preferred_element_type=jnp.float32)
    aux_BTA = jnp.concatenate(aux, axis=-1) if aux else jnp.zeros((*x_BTH.shape[:2], 0), x_BTH.dtype)
    new_cache = cache.replace(latent=tuple(latents), k_rope=tuple(k_ropes))
    return DeviceForward(greedy_tokens(logits_BTV, cfg.vocab_size, cuts), aux_BTA, new_cache, tuple(chosen))


@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """What jaxspec.spec_step's draft reads of the target: its (vocab-split) embedding; the draft's own lm_head."""

    embed: object
    lm_head: None = None


def device_cycle(w: SpecWeights, state: SpecState, first_expert_L, expert_ids_LTK=None, *, cfg: SpecConfig, k: int,
                 cuts: CollectiveCuts) -> SpecState:
    """jaxspec.spec_step.speculative_cycle_accepting (greedy) as one device runs it, the verify's experts set by
    `expert_ids_LTK` (None: the router's). The draft is whole on every device and must have its own lm_head
    (bench.cycle draws it so); its input embedding is the target's, split over the vocabulary."""
    if w.draft.lm_head is None:
        raise ValueError("bench.per_device: the draft needs its own lm_head (the target's is split over devices)")
    key, k_draft, _ = jax.random.split(state.key, 3)
    embed = embedding_table(w.target.embed, cfg.target.vocab_size, cuts,
                           "draft input embedding (the target's embed, split over the vocabulary)")
    drafts_BM, _, draft_cache = draft_chain(k_draft, SpecWeights(DraftInputs(embed), w.draft), cfg, state, k, True, {})
    lengths_B = state.target_cache.lengths
    verify_tokens_BK1 = jnp.concatenate([state.pending[:, None], drafts_BM], axis=1)
    positions_BK1 = lengths_B[:, None] + jnp.arange(k + 1)[None]
    verify = device_forward(w.target, cfg.target, verify_tokens_BK1, positions_BK1, state.target_cache,
                            first_expert_L, cuts, expert_ids=expert_ids_LTK)
    target_BK1 = verify.tokens_BT
    # jaxspec.acceptance.greedy_accept, from the tokens the argmax over the vocab shards picked
    accepted_B = jnp.cumprod((drafts_BM == target_BK1[:, :-1]).astype(jnp.int32), axis=1).sum(axis=1)
    ext = draft_forward(w.draft, cfg.draft, embed, None, target_BK1, verify.aux_hidden, positions_BK1, draft_cache)
    pick = accepted_B[:, None, None]
    next_logits = jnp.take_along_axis(ext.logits, pick, axis=1)[:, 0]
    next_hidden = jnp.take_along_axis(ext.hidden, pick, axis=1)[:, 0]
    return commit(state, cfg, key, accepted_B, target_BK1, verify.cache, ext.cache, next_logits, next_hidden,
                  MAX_NEW_TOKENS)


def device_rows(tokens, rows: int):
    """Token ids among the vocabulary rows this device holds: its embedding is then a token's own row, not the zeros
    of a row another device adds (the same kernels either way; a zero input would route every token alike)."""
    return VOCAB_FIRST_ROW + tokens % rows


# --- programs -------------------------------------------------------------------------------------------------
class Program(NamedTuple):
    fn: object  # the function to jit
    args: tuple  # example arguments (shapes and dtypes are what it is compiled for)
    donate: tuple  # donated argument numbers
    cuts: CollectiveCuts  # filled when it is traced


def moe_layer_count(cfg) -> int:
    return cfg.num_hidden_layers - cfg.first_k_dense_replace


def step_arguments(w, cfg, batch: int, tokens: int, context: int, key, shard_of: int = SHARD_OF) -> tuple:
    """(tokens [B, T], positions, the latent cache's device block) of a step after `context` tokens."""
    cache = local_block(random_cache(cfg, batch, round_capacity(context + 16), context, key), CACHE_RULES, shard_of)
    tokens_BT, positions_BT = step_inputs(cfg, batch, tokens, context, key)
    return device_rows(tokens_BT, w.embed.shape[0]), positions_BT, cache


def step_probe(w, cfg, step_args: tuple) -> Program:
    """One step with the model's router choosing (every MoE layer playing device 0): (w, tokens, positions, cache,
    first_expert_L) -> the experts each MoE layer chose [MoE layers, B*T, K], the routing the timed loops replay."""
    cuts = CollectiveCuts()

    def probe(w, tokens_BT, positions_BT, cache, first_expert_L):
        out = device_forward(w, cfg, tokens_BT, positions_BT, cache, first_expert_L, cuts)
        return jnp.stack(out.expert_ids)

    return Program(probe, (w, *step_args, jnp.zeros((moe_layer_count(cfg),), jnp.int32)), (), cuts)


def step_loop(w, cfg, step_args: tuple) -> Program:
    """`steps` target steps in one device loop, each fed the previous step's greedy tokens, every MoE layer running
    the experts set for it: (w, tokens [B, T], positions, cache, expert_ids [MoE layers, B*T, K], first_expert_L,
    steps) -> (tokens, cache). Set experts (bench.routes' regimes, or the router's as `step_probe` found them) make
    every step route alike, so the device each layer plays stays its busiest."""
    cuts = CollectiveCuts()

    def loop(w, tokens_BT, positions_BT, cache, expert_ids_LTK, first_expert_L, steps):
        def body(_, carry):
            cuts.sites.clear()  # the body is one step; a (re)trace records it afresh
            toks, c = carry
            out = device_forward(w, cfg, toks, positions_BT, c, first_expert_L, cuts, expert_ids=expert_ids_LTK)
            return out.tokens_BT, out.cache

        return jax.lax.fori_loop(0, steps, body, (tokens_BT, cache))

    tokens_BT = step_args[0]
    moe_layers = moe_layer_count(cfg)
    ids_L, first_L = per_layer(np.zeros((moe_layers, tokens_BT.size, cfg.num_experts_per_tok)), np.zeros(moe_layers))
    return Program(loop, (w, *step_args, ids_L, first_L, jnp.int32(1)), (3,), cuts)


def cycle_loop(sw: SpecWeights, spec_cfg: SpecConfig, k: int, batch: int, context: int, capacity: int, key,
               shard_of: int = SHARD_OF) -> Program:
    """`cycles` speculative cycles in one device loop, the verify's MoE layers running the experts set for them:
    (weights, state, expert_ids [MoE layers, B*(K+1), topk], first_expert_L, cycles) -> state."""
    cuts = CollectiveCuts()
    cfg = spec_cfg.target
    moe_layers = moe_layer_count(cfg)

    def loop(sw, state, expert_ids_LTK, first_expert_L, cycles):
        def body(_, s):
            cuts.sites.clear()
            return device_cycle(sw, s, first_expert_L, expert_ids_LTK, cfg=spec_cfg, k=k, cuts=cuts)

        return jax.lax.fori_loop(0, cycles, body, state)

    state = local_block(initial_state(cfg, spec_cfg.draft, batch, context, capacity, key), STATE_RULES, shard_of)
    state = state.replace(pending=device_rows(state.pending, sw.target.embed.shape[0]))
    ids_L, first_L = per_layer(np.zeros((moe_layers, batch * (k + 1), cfg.num_experts_per_tok)),
                               np.zeros(moe_layers))
    return Program(loop, (sw, state, ids_L, first_L, jnp.int32(1)), (1,), cuts)


def per_layer(ids_LTK, first_L) -> tuple[tuple, tuple]:
    """The experts each MoE layer runs and the first expert of the device it plays, one array a layer: the engine
    hands each layer its router's ids and its device's first expert, where slices of stacked arrays would be kernels
    of their own (the routed-experts kernels take them as operands)."""
    return (tuple(jnp.asarray(ids, jnp.int32) for ids in np.asarray(ids_LTK)),
            tuple(jnp.int32(f) for f in np.asarray(first_L)))


# --- what a program runs --------------------------------------------------------------------------------------
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLED = re.compile(r"\b(body|condition|true_computation|false_computation|branch_computations|to_apply)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")
# top-level ops that launch nothing: values, tuples, views, control flow (counted through what it runs)
FREE_OPS = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "while", "conditional", "call",
            "opt-barrier", "after-all", "add-dependency", "partition-id", "replica-id", "domain"}


class HloInstruction(NamedTuple):
    name: str
    shape: str  # its output shape
    op: str
    rest: str  # its operands and attributes, as printed


class Kernel(NamedTuple):
    name: str  # the HLO instruction's name (fusions carry XLA's kind of fusion in it)
    kind: str  # the fusion's name less its number, a custom call's target, or the op
    shape: str  # its output shape


def hlo_computations(hlo_text: str) -> tuple[dict[str, list[HloInstruction]], str | None]:
    """An optimised HLO module's computations by name, each its instructions in the printed (scheduled) order,
    and the entry computation's name."""
    comps, entry, name = {}, None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(2)
            comps[name] = []
            entry = name if m.group(1) else entry
            continue
        m = _INSTRUCTION.match(line)
        if m and name is not None:
            comps[name].append(HloInstruction(*m.group(1, 2, 3, 4)))
    return comps, entry


def kernels_in_order(hlo_text: str) -> list[Kernel]:
    """The kernels an optimised HLO module launches per run of its top level, in program order (a loop's body
    once): every op outside fusion bodies and reducers that does work (fusions, named by their name less its number,
    e.g. `loop_add_fusion`; custom calls, by their target: Pallas / Mosaic kernels and cuBLAS GEMMs; whatever a
    backend runs unfused, by its op), in the entry computation and the loops, branches and calls it runs."""
    comps, entry = hlo_computations(hlo_text)
    out = []
    for comp in launching_computations(comps, entry):
        for ins in comps[comp]:
            if ins.op not in FREE_OPS:
                target = _TARGET.search(ins.rest) if ins.op == "custom-call" else None
                kind = target.group(1) if target else re.sub(r"[.\d]+$", "", ins.name) if ins.op == "fusion" else ins.op
                out.append(Kernel(ins.name, kind, ins.shape))
    return out


def launching_computations(comps: dict, entry: str | None) -> list[str]:
    """The computations whose instructions launch kernels, in the order a walk from the entry meets them: the entry
    and the loops, branches and calls it runs (fusion bodies and reducers run inside the kernel that calls them)."""
    seen: list[str] = []

    def walk(comp):
        if comp is None or comp in seen or comp not in comps:
            return
        seen.append(comp)
        for ins in comps[comp]:
            if ins.op in FREE_OPS:
                for attr, called in _CALLED.findall(ins.rest):
                    if attr == "to_apply" and ins.op != "call":
                        continue
                    for c in called.strip("{}").split(","):
                        walk(c.strip().lstrip("%"))

    walk(entry)
    return seen


def kernel_census(hlo_text: str) -> Counter:
    """`kernels_in_order`'s kernels counted by kind."""
    return Counter(k.kind for k in kernels_in_order(hlo_text))


def kernel_launches(hlo_text: str) -> int:
    """Kernels an optimised HLO module launches per run of its top level (`kernel_census`, all kinds)."""
    return sum(kernel_census(hlo_text).values())


def busiest_devices(ids_LTK, num_local: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Per MoE layer, the first expert id of the device that received the most (token, choice) pairs, and how many
    it received."""
    ids = np.asarray(ids_LTK).reshape(len(ids_LTK), -1)
    devices = num_experts // num_local
    counts_LD = np.stack([(ids // num_local == d).sum(axis=1) for d in range(devices)], axis=1)
    return (counts_LD.argmax(axis=1) * num_local).astype(np.int32), counts_LD.max(axis=1)


def local_slots(ids_LTK, first_L, num_local: int) -> tuple[list[int], list[int]]:
    """Per MoE layer: (the (token, choice) pairs on experts [first, first + num_local), the distinct experts among
    them: what the device's kernel reads)."""
    slots, unique = [], []
    for ids, first in zip(np.asarray(ids_LTK), np.asarray(first_L)):
        mine = ids[(ids >= first) & (ids < first + num_local)]
        slots.append(int(mine.size))
        unique.append(int(np.unique(mine).size))
    return slots, unique


def rewind_state(state: SpecState, start: dict) -> SpecState:
    """`state` (its caches as the last cycle left them) back at the lengths, counts and flags of `start` (host
    values: the state they came from is donated), so that successive loop calls run at the same context."""
    return state.replace(target_cache=state.target_cache.replace(lengths=jnp.asarray(start["lengths"])),
                         **{k: jnp.asarray(start[k]) for k in ("done", "generated", "cycles")})


# --- the benchmark --------------------------------------------------------------------------------------------
def prefix_config(cfg, layers: int):
    return cfg.replace(num_hidden_layers=layers,
                       aux_layer_ids=tuple(i for i in cfg.eagle_aux_layers if i < layers) or (0,))


def neighbour_ids(cfg, batch: int, tokens: int) -> np.ndarray:
    """[MoE layers, B*T, K]: bench.routes' neighbour regime for every MoE layer (bench.step's draw)."""
    return np.stack([np.asarray(i) for i in step_routes(cfg, "neighbour", jnp.zeros((batch, tokens), jnp.int32))])


class Timed:
    """A compiled device loop called again and again, its donated argument replaced by the output that carries it."""

    def __init__(self, compiled, args: tuple, donated: int, carried: int, rewind=None):
        self.compiled, self.args, self.rewind = compiled, list(args), rewind
        self.donated, self.carried = donated, carried

    def route(self, ids_LTK, first_L):
        """The experts every MoE layer runs and the devices the layers play (the two arguments before the count)."""
        self.args[-3], self.args[-2] = per_layer(ids_LTK, first_L)

    def __call__(self, n: int):
        """Run `n` steps (or cycles); returns the first output (what a timing waits for)."""
        self.args[-1] = jnp.int32(n)
        if self.rewind is not None:
            self.args[self.donated] = self.rewind(self.args[self.donated])
        out = self.compiled(*self.args)
        out = out if isinstance(out, tuple) else (out,)
        self.args[self.donated] = out[self.carried]
        return out[0]


def routed_row(ids_LTK, num_local: int, num_experts: int) -> tuple[np.ndarray, dict]:
    """The devices the MoE layers play (each its busiest) and what they run: (first_expert_L, row fields)."""
    first_L, _ = busiest_devices(ids_LTK, num_local, num_experts)
    slots, unique = local_slots(ids_LTK, first_L, num_local)
    return first_L, dict(busiest_device_slots=slots, local_unique_experts=unique)


def run_step(entry: dict, routing: str, ids_LTK, args, cfg, num_local: int, log) -> dict:
    """One (routing, T) row: the step at N layers and at the prefix depth, with the experts `ids_LTK` set."""
    t = entry["tokens"]
    first_L, routed = routed_row(ids_LTK, num_local, cfg.n_routed_experts)
    entry["run"].route(ids_LTK, first_L)
    timing = device_loop_ms(entry["run"], args.loop_steps, args.iters)
    parts = step_bytes(entry["w"], cfg, args.batch, t, args.context, routed["local_unique_experts"])
    cuts = entry["program"].cuts
    row = dict(kind="decode" if t == 1 else "verify", shard_of=args.shard_of, layers=cfg.num_hidden_layers,
               tokens=t, batch=args.batch, context=args.context, routing=routing,
               step_ms=timing["device_loop_ms"], step_fixed_ms=timing["device_loop_fixed_ms"],
               collectives_cut=cuts.by_kind(), collective_sites=cuts.sites, kernels=entry["kernels"], **routed,
               bytes=parts, floor_ms=floor_ms(parts["total"], HBM_TBS), layer_us=None, kernels_per_layer=None,
               layer_floor_us=None)
    row["x_floor"] = row["step_ms"] / row["floor_ms"]
    row["layer_us_whole_step"] = 1e3 * row["step_ms"] / row["layers"]
    pre = entry.get("prefix")
    if pre is not None:
        m = pre["cfg"].num_hidden_layers
        pre_moe = moe_layer_count(pre["cfg"])
        pre["run"].route(np.asarray(ids_LTK)[:pre_moe], first_L[:pre_moe])
        pre_ms = device_loop_ms(pre["run"], args.loop_steps, args.iters)["device_loop_ms"]
        pre_parts = step_bytes(pre["w"], pre["cfg"], args.batch, t, args.context,
                               routed["local_unique_experts"][:pre_moe])
        span = row["layers"] - m
        pre_cut = pre["program"].cuts.by_kind()
        row.update(prefix_layers=m, prefix_step_ms=pre_ms, layer_us=1e3 * (row["step_ms"] - pre_ms) / span,
                   kernels_per_layer=(row["kernels"] - pre["kernels"]) / span,
                   layer_floor_us=1e3 * floor_ms(parts["total"] - pre_parts["total"], HBM_TBS) / span,
                   collectives_per_layer={k: (n - pre_cut.get(k, 0)) / span for k, n in row["collectives_cut"].items()})
        row["layer_x_floor"] = row["layer_us"] / row["layer_floor_us"]
        by_kind = {k: (entry["census"].get(k, 0) - pre["census"].get(k, 0)) / span
                   for k in {*entry["census"], *pre["census"]}}
        row["kernels_per_layer_by_kind"] = dict(sorted(((k, v) for k, v in by_kind.items() if v), key=lambda x: -x[1]))
    log(f"T={t} {routing:9s}: step {row['step_ms']:.3f} ms (floor {row['floor_ms']:.3f}, x{row['x_floor']:.2f}), "
        f"layer {fmt(row['layer_us'], 1)} us (floor {fmt(row['layer_floor_us'], 1)}), "
        f"{fmt(row['kernels_per_layer'], 1)} kernels a layer, collectives cut {row['collectives_cut']}, busiest "
        f"device {np.mean(routed['busiest_device_slots']):.2f} slots / {np.mean(routed['local_unique_experts']):.2f} "
        f"experts a layer")
    return row


def run_cycle(entry: dict, routing: str, ids_LTK, args, spec_cfg: SpecConfig, sw: SpecWeights, num_local: int,
              decode_ms, log) -> dict:
    """One (routing, K) row: the cycle in a device loop, its verify's experts `ids_LTK`."""
    k = entry["k"]
    first_L, routed = routed_row(ids_LTK, num_local, spec_cfg.target.n_routed_experts)
    entry["run"].route(ids_LTK, first_L)
    timing = device_loop_ms(lambda n: entry["run"](n).generated, args.loop_steps, args.iters)
    verify = step_bytes(sw.target, spec_cfg.target, args.batch, k + 1, args.context,
                        routed["local_unique_experts"])["total"]
    drafts = (k - 1) * draft_bytes(sw.draft, spec_cfg.draft, args.batch, 1, args.context) + draft_bytes(
        sw.draft, spec_cfg.draft, args.batch, k + 1, args.context)
    cuts = entry["program"].cuts
    row = dict(kind="cycle", shard_of=args.shard_of, layers=spec_cfg.target.num_hidden_layers, tokens=k + 1, k=k,
               batch=args.batch, context=args.context, routing=routing, draft=args.draft_kind,
               step_ms=timing["device_loop_ms"], step_fixed_ms=timing["device_loop_fixed_ms"],
               collectives_cut=cuts.by_kind(), collective_sites=cuts.sites, kernels=entry["kernels"], layer_us=None,
               kernels_per_layer=None, **routed, bytes=dict(verify=verify, drafts=drafts, total=verify + drafts),
               floor_ms=floor_ms(verify + drafts, HBM_TBS))
    row["x_floor"] = row["step_ms"] / row["floor_ms"]
    row["cycle_over_decode"] = row["step_ms"] / decode_ms if decode_ms else None
    log(f"cycle K={k} {routing:9s}: {row['step_ms']:.3f} ms (floor {row['floor_ms']:.3f}, x{row['x_floor']:.2f}), "
        f"/ decode {fmt(row['cycle_over_decode'], 2)}, collectives cut {row['collectives_cut']}")
    return row


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# One device of {a['shard_of']}: {result['device']}, jax {result['jax']}, {result['date']}", "",
             f"Kimi-K2.5 dims{' (tiny)' if a['tiny'] else ''}, {a['layers']} layers ({a['moe_layers']} MoE layers), "
             f"the shapes one device of a 1 x {a['shard_of']} mesh holds ({result['weight_bytes_per_device'] / 1e9:.2f}"
             f" GB of weights), B = {a['batch']}, context {a['context']}, kernels as the sharded engine dispatches "
             f"them (moe {a['moe_kernel']}). Collectives cut "
             "out (counted per step); times per step inside one device loop (medians of synchronised calls); layer = "
             "(N-layer step - M-layer step) / (N - M); floor = this device's bytes / 4.3 TB/s; slots and experts: "
             "the busiest device's per MoE layer (mean). Method: bench/per_device.py.", "",
             "| kind | T | routing | step ms | floor ms | x floor | layer us | layer floor us | x floor | "
             "layer us (step / N) | kernels / layer | all-reduces / step | all-gathers / step | slots | experts |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r["collectives_cut"]
        lines.append(
            f"| {r['kind']}{' K=' + str(r['k']) if r['kind'] == 'cycle' else ''} | {r['tokens']} | {r['routing']} | "
            f"{r['step_ms']:.3f} | {r['floor_ms']:.3f} | {r['x_floor']:.2f} | {fmt(r['layer_us'], 1)} | "
            f"{fmt(r.get('layer_floor_us'), 1)} | {fmt(r.get('layer_x_floor'), 2)} | "
            f"{fmt(r.get('layer_us_whole_step'), 1)} | {fmt(r['kernels_per_layer'], 1)} | {c.get(ALL_REDUCE, 0)} | "
            f"{c.get(ALL_GATHER, 0)} | {np.mean(r['busiest_device_slots']):.2f} | "
            f"{np.mean(r['local_unique_experts']):.2f} |")
    sites = next((r["collective_sites"] for r in result["rows"] if r["kind"] == "decode"), None)
    if sites:
        lines += ["", "Collectives cut in one decode step, by where they sit: " + "; ".join(
            f"{n} x {kind} at {where}" for (kind, where), n in Counter(map(tuple, sites)).items()) + "."]
    census = [r for r in result["rows"] if r.get("kernels_per_layer_by_kind")]
    if census:
        lines += ["", "Kernels a layer by kind (the N-layer program's launches less the M-layer one's, / (N - M); "
                  "fusions by name, custom calls by target):", ""]
        seen = set()
        for r in census:
            if (r["kind"], r["tokens"]) in seen:  # the programs do not depend on the routing
                continue
            seen.add((r["kind"], r["tokens"]))
            lines.append(f"- {r['kind']} T = {r['tokens']}: " + ", ".join(
                f"{k} {v:g}" for k, v in r["kernels_per_layer_by_kind"].items()))
    for key in ("skipped", "errors"):
        if result.get(key):
            lines += ["", f"{key.capitalize()}:", ""] + [f"- {e[:400]}" for e in result[key]]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.per_device", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=61, help="target layers (the first dense, the rest MoE)")
    p.add_argument("--prefix-layers", type=int, default=None,
                   help="also time the first M layers: layer_us = the difference / (N - M) (default N // 2, at least "
                        "the dense layers; 0 = off)")
    p.add_argument("--shard-of", type=int, default=SHARD_OF, help="devices of the 1 x N mesh this device is one of")
    p.add_argument("--tiny", action="store_true", help="small dims that divide by 8, for a CPU smoke run")
    p.add_argument("--moe-layers", choices=("distinct", "repeated"), default="repeated",
                   help="repeated: one MoE layer's local arrays run by every MoE layer (bench.step.draw_weights)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--cycle-k", type=int, nargs="*", default=[1, 2, 3, 4])
    p.add_argument("--routing", choices=ROUTINGS, nargs="+", default=list(ROUTINGS),
                   help="the steps' expert choices: the model's router, or bench.routes' neighbour regime (cycles: "
                        "the router)")
    p.add_argument("--draft-kind", choices=("llama", "mla"), default="llama")
    p.add_argument("--moe-kernel", choices=KERNEL_PATH_MOE, default="auto")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--loop-steps", type=int, default=10, help="steps of the short device loop (the long runs 3x)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new timing after this")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--hlo", action="store_true",
                   help="also write each timed program's optimised HLO (gzipped) to --out, for bench.depth_gap_hlo")
    return p.parse_args(argv)


def build_programs(w, cfg, args, m: int) -> tuple[dict, list, list, object]:
    """Every program of the run (nothing compiled yet): ({T: probe}, step entries, cycle entries, (spec_cfg, sw))."""
    key = jax.random.PRNGKey(1)
    probes, steps, cycles = {}, [], []
    probe_tokens = set(args.tokens) | {k + 1 for k in args.cycle_k}
    for t in sorted(set(args.tokens) | probe_tokens, key=lambda t: (t not in (1, 4), t)):
        key, sub = jax.random.split(key)
        step_args = step_arguments(w, cfg, args.batch, t, args.context, sub, args.shard_of)
        if "model" in args.routing and t in probe_tokens:
            probes[t] = step_probe(w, cfg, step_args)
        if t not in args.tokens:
            continue
        entry = dict(tokens=t, w=w, program=step_loop(w, cfg, step_args))
        if m:
            pcfg = prefix_config(cfg, m)
            pw = dataclasses.replace(w, layers=w.layers[:m])
            entry["prefix"] = dict(tokens=t, cfg=pcfg, w=pw, program=step_loop(pw, pcfg, step_arguments(
                pw, pcfg, args.batch, t, args.context, sub, args.shard_of)))
        steps.append(entry)
    pair = None
    if args.cycle_k:
        spec_cfg, _, sw = spec_pair(w, cfg, args.tiny, args.draft_kind)
        # the draft takes the target's kernel choices (as bench.cycle's loops give it them)
        spec_cfg = dataclasses.replace(spec_cfg, draft=dataclasses.replace(spec_cfg.draft, kernels=cfg.kernels))
        sw = SpecWeights(sw.target, local_block(sw.draft, DRAFT_RULES, args.shard_of))
        pair = (spec_cfg, sw)
        for k in args.cycle_k:
            key, sub = jax.random.split(key)
            # every call starts where the first did (`rewind_state`): the cache holds one call's cycles, as long as
            # the steps' (XLA's attention reads every slot of it)
            capacity = round_capacity(args.context + 16 + 3 * args.loop_steps * (k + 1))
            program = cycle_loop(sw, spec_cfg, k, args.batch, args.context, capacity, sub, args.shard_of)
            state = program.args[1]
            start = jax.device_get(dict(lengths=state.target_cache.lengths, done=state.done,
                                        generated=state.generated, cycles=state.cycles))
            cycles.append(dict(k=k, program=program, rewind=functools.partial(rewind_state, start=start)))
    return probes, steps, cycles, pair


def program_name(entry: dict, layers: int) -> str:
    """A timed program's name in file names: step-T1-L61, step-T4-L60 (a prefix), cycle-K3."""
    if "k" in entry:
        return f"cycle-K{entry['k']}"
    return f"step-T{entry.get('tokens', 0)}-L{len(entry['w'].layers) if 'w' in entry else layers}"


def save_hlo(text: str, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / f"{name}.hlo.txt.gz", "wt") as f:
        f.write(text)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.time()
    log = functools.partial(print, flush=True)
    cfg = per_device_config(args.layers, args.tiny)
    cfg = cfg.replace(kernels=Kernels(moe=args.moe_kernel))
    m = args.prefix_layers if args.prefix_layers is not None else max(cfg.first_k_dense_replace, args.layers // 2)
    if m and not cfg.first_k_dense_replace <= m < args.layers:
        raise SystemExit(f"--prefix-layers must be 0 or between {cfg.first_k_dense_replace} and {args.layers - 1}")
    stamp = run_stamp()
    dev = stamp.device
    result = dict(**stamp.fields, xla_flags=os.environ.get("XLA_FLAGS", ""),
                  args=vars(args), rows=[], skipped=[], errors=[],
                  weight_bytes_per_device=local_weight_bytes(cfg, args.shard_of))
    stem = f"per-device-{'tiny-' if args.tiny else ''}{stamp.suffix}"

    t0 = time.perf_counter()
    w = local_weights(cfg, args.shard_of, args.tiny, args.moe_layers)
    num_local = next(lw.mlp.experts.num_experts for lw in w.layers if isinstance(lw.mlp, MoEWeights))
    log(f"{dev.device_kind}: one device of {args.shard_of}, {args.layers} layers ({args.moe_layers} MoE layers), "
        f"{num_local} of {cfg.n_routed_experts} experts, weights drawn in {time.perf_counter() - t0:.1f} s "
        f"({result['weight_bytes_per_device'] / 1e9:.2f} GB a device holds)")

    # every program traced and lowered, then compiled side by side (jaxspec.sharded.compile_programs)
    t0 = time.perf_counter()
    probes, steps, cycles, pair = build_programs(w, cfg, args, m)
    timed = steps + [e["prefix"] for e in steps if "prefix" in e] + cycles
    programs = list(probes.values()) + [e["program"] for e in timed]
    compiled = compile_programs([(p.fn, p.args, p.donate) for p in programs])
    result["compile_s"] = time.perf_counter() - t0
    log(f"{len(programs)} programs traced, lowered and compiled in {result['compile_s']:.1f} s")
    probe_ids = {t: np.asarray(c(*p.args)) for (t, p), c in zip(probes.items(), compiled)}  # the router's choices
    for e, c in zip(timed, compiled[len(probes):]):
        e["census"] = kernel_census(c.as_text())
        if args.hlo:
            name = f"{own_stem(Path(args.out), stem)}-{program_name(e, args.layers)}"  # beside this run's JSON
            save_hlo(c.as_text(), Path(args.out), name)
        e["kernels"] = sum(e["census"].values())
        e["run"] = Timed(c, e["program"].args, e["program"].donate[0], 1 if "k" not in e else 0, e.get("rewind"))

    def routes(t: int, routing: str):
        return probe_ids[t] if routing == "model" else neighbour_ids(cfg, args.batch, t)

    save = lambda: publish(result, Path(args.out), stem, markdown, lambda _: None)  # noqa: E731
    over_budget = lambda: time.time() - t_start > args.budget_s  # noqa: E731
    todo = [("step", e, r) for r in args.routing for e in steps]
    todo += [("cycle", e, r) for r in args.routing for e in cycles]
    for what, e, routing in todo:
        name = f"{what} {'T=' + str(e['tokens']) if what == 'step' else 'K=' + str(e['k'])} routing {routing}"
        if over_budget():
            result["skipped"].append(name)
            continue
        try:
            if what == "step":
                row = run_step(e, routing, routes(e["tokens"], routing), args, cfg, num_local, log)
            else:
                decode_ms = next((r["step_ms"] for r in result["rows"] if r["kind"] == "decode"
                                  and r["routing"] == routing), None)
                row = run_cycle(e, routing, routes(e["k"] + 1, routing), args, *pair, num_local, decode_ms, log)
            result["rows"].append(row)
        except Exception as ex:  # a row that fails leaves the others standing
            result["errors"].append(f"{name}: {type(ex).__name__}: {ex}"[:2000])
            traceback.print_exc()
        save()
    result["wall_s"] = time.time() - t_start
    publish(result, Path(args.out), stem, markdown, log)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
