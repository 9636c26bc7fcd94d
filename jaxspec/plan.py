"""`python -m jaxspec.plan`: per-device memory of a Kimi target + EAGLE-3 draft on a mesh, and whether it fits.

    python -m jaxspec.plan --config kimi-k2.5 --devices 8 --device-memory 141GB --context 131072 --batch 1

Weights and caches are counted from the same sources the real run uses: the weight pytrees of model/init.py
and the caches' init functions, shaped by `jax.eval_shape` (nothing is allocated), split by the partition
rules of model/sharding.py over an abstract mesh of the requested shape. Working memory is an estimate:
the largest transient buffers of the speculative cycle (and, separately, of a one-program prefill).
GB here means 10**9 bytes (H200: 141 GB).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from convert.help_format import DefaultsHelpFormatter
from jaxspec.cli_common import OneLineParser, require_at_least, run_with_exit_codes
from jaxspec.defaults import DEFAULT_NUM_STEPS
from jaxspec.prefill import DEFAULT_CHUNK, MIN_BUCKET
from jaxspec.serving.prefix_pages import PAGE_TOKENS
from model.config import TextConfig
from model.configs import KNOWN, known_config
from model.configs.drafts import KNOWN_DRAFTS, known_draft_config
from model.eagle3 import DraftConfig, init_draft_cache, init_paged_draft_cache
from model.init import init_draft_weights, init_kimi_weights
from model.kv_cache import init_latent_cache, init_paged_latent_cache, round_capacity
from model.quant import Fp8Weight
from model.sharding import (CACHE_RULES, DRAFT_RULES, MESH_AXES, TARGET_RULES, LOGICAL_TO_MESH, path_str,
                            shard_shape, specs_for)

GB = 10**9
DEFAULT_DRAFT = {"kimi-k2.5": "kimi-k2.5-eagle3", "kimi-k2-thinking": "kimi-k2.5-eagle3",
                 "kimi-k2-instruct": "kimi-k2.5-eagle3", "kimi-k2-instruct-0905": "kimi-k2.5-eagle3",
                 "kimi-k2.6": "kimi-k2.6-eagle3.1-mla", "kimi-k2.7-code": "kimi-k2.7-coder-eagle3.1-mla"}

WEIGHT_CATEGORIES = ("attention", "dense", "shared", "routed experts", "embed", "lm_head", "norms/router",
                     "fc (aux states)", "draft vocab map")
FORMATS = ("bf16", "int4 packed", "int4 scales", "fp8", "fp8 scales", "f32", "int32", "other")


# --- abstract trees ---------------------------------------------------------------------------------------
def _fp8_experts(tree, block=(128, 128)):
    """Routed experts as the converter keeps FP8 checkpoints: e4m3 bytes + f32 block scales."""
    def one(path, leaf):
        if not re.search(r"\.mlp\.experts\.(gate|up|down)$", path_str(path)):
            return leaf
        *lead, out, inp = leaf.shape
        return Fp8Weight(jax.ShapeDtypeStruct(leaf.shape, jnp.float8_e4m3fn),
                         jax.ShapeDtypeStruct((*lead, -(-out // block[0]), -(-inp // block[1])), jnp.float32),
                         tuple(block))

    return jax.tree_util.tree_map_with_path(one, tree)


def abstract_target(cfg: TextConfig, experts: str, dtype=jnp.bfloat16):
    """The target's weight pytree as ShapeDtypeStructs; experts "int4", "fp8" or "bf16"."""
    init_as = "int4" if experts == "int4" else "bf16"
    tree = jax.eval_shape(lambda k: init_kimi_weights(cfg, k, dtype, experts=init_as), jax.random.key(0))
    if experts == "fp8":
        block = cfg.quant.block_size if cfg.quant and cfg.quant.method == "fp8" else (128, 128)
        tree = _fp8_experts(tree, block)
    return tree


def abstract_draft(dcfg: DraftConfig, dtype=jnp.bfloat16):
    """The draft's weights with its own lm_head (published drafters ship one, full-vocabulary ones included:
    vLLM loads it from the drafter) and the target's embeddings."""
    d2t = np.zeros(dcfg.draft_vocab_size, np.int32)
    return jax.eval_shape(lambda k: init_draft_weights(dcfg, k, dtype, d2t=d2t), jax.random.key(0))


def abstract_caches(cfg: TextConfig, dcfg: DraftConfig | None, batch: int, capacity: int, dtype=jnp.bfloat16,
                    cache_pages: int | None = None):
    """The target's and the draft's caches (shapes only); with `cache_pages`, the server's paged caches: one pool
    of that many pages each, shared by the `batch` sequences (jaxspec.serving.slots.init_slots)."""
    if cache_pages is not None:
        target = jax.eval_shape(lambda: init_paged_latent_cache(cfg, batch, capacity, cache_pages, PAGE_TOKENS, dtype))
        draft = None if dcfg is None else jax.eval_shape(
            lambda: init_paged_draft_cache(dcfg, cache_pages, PAGE_TOKENS, dtype))
        return target, draft
    target = jax.eval_shape(lambda: init_latent_cache(cfg, batch, capacity, dtype))
    draft = None if dcfg is None else jax.eval_shape(lambda: init_draft_cache(dcfg, batch, capacity, dtype))
    return target, draft


# --- counting ---------------------------------------------------------------------------------------------
def weight_category(path: str) -> str:
    """Target paths (`layers.3.attn.o_proj`) and draft paths (`q_proj`, `mlp.gate`) alike."""
    if re.search(r"(^|\.)embed$", path):
        return "embed"
    if re.search(r"(^|\.)lm_head$", path):
        return "lm_head"
    if re.search(r"norm$|\.router(_bias)?$", path):
        return "norms/router"
    if ".attn." in path or re.fullmatch(r"[qkvo]_proj", path) or path.startswith("mla."):
        return "attention"
    if ".mlp.experts." in path:
        return "routed experts"
    if ".mlp.shared." in path:
        return "shared"
    if re.search(r"(^|\.)mlp\.", path):
        return "dense"
    if path == "fc":
        return "fc (aux states)"
    if path == "d2t":
        return "draft vocab map"
    return "other"


def weight_format(path: str, dtype) -> str:
    if path.endswith(".packed"):
        return "int4 packed"
    if path.endswith(".scale"):
        return "int4 scales"
    if path.endswith(".scale_inv"):
        return "fp8 scales"
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float8_e4m3fn:
        return "fp8"
    if dtype == jnp.bfloat16:
        return "bf16"
    if dtype == jnp.float32:
        return "f32"
    if dtype == jnp.int32:
        return "int32"
    return "other"


def leaf_bytes_per_device(tree, mesh, rules) -> list[tuple[str, object, int]]:
    """(path, dtype, bytes one device holds) per leaf of `tree` split by `rules` on `mesh`."""
    specs = specs_for(tree, mesh, rules)
    out = []
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree_util.tree_leaves(specs)):
        shape = shard_shape(spec, tuple(leaf.shape), mesh)
        out.append((path_str(path), leaf.dtype, int(math.prod(shape)) * jnp.dtype(leaf.dtype).itemsize))
    return out


def bytes_by_category(tree, mesh, rules) -> dict[tuple[str, str], int]:
    """{(category, format): bytes per device}."""
    table: dict[tuple[str, str], int] = defaultdict(int)
    for path, dtype, nbytes in leaf_bytes_per_device(tree, mesh, rules):
        table[(weight_category(path), weight_format(path, dtype))] += nbytes
    return dict(table)


def bytes_per_device(tree, mesh, rules) -> int:
    return sum(n for _, _, n in leaf_bytes_per_device(tree, mesh, rules))


def _size(mesh, logical: str, dim: int) -> int:
    """How many ways `dim` is split when its logical axis is `logical` (1 if the rules replicate it)."""
    axes = LOGICAL_TO_MESH[logical]
    axes = axes if isinstance(axes, tuple) else (axes,)
    n = int(np.prod([mesh.shape[a] for a in axes]))
    return n if dim % n == 0 else 1


# --- working memory ---------------------------------------------------------------------------------------
def cycle_working_bytes(cfg: TextConfig, dcfg: DraftConfig | None, mesh, batch: int, capacity: int, k: int,
                        act_bytes: int = 2, paged: bool = False) -> dict[str, int]:
    """Largest transient buffers of one speculative cycle (verify width T = K+1), per device.

    Routed experts use the plain-XLA gather path, which materializes one dequantized expert per (token,
    choice) pair on every device (the Pallas kernel on GPU does not); attention keeps f32 scores and
    probabilities over the whole cache. A paged draft cache (`paged`) is gathered into each sequence's contiguous
    cache for its attention, every draft step."""
    t = k + 1
    b_local = batch // _size(mesh, "batch", batch)
    heads = cfg.num_attention_heads // _size(mesh, "heads", cfg.num_attention_heads)
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * act_bytes
    out = {
        "target attention scores": b_local * heads * t * capacity * (4 + act_bytes),
        "routed experts gathered": batch * t * cfg.num_experts_per_tok * expert,  # tokens are all-gathered
        "logits": batch * t * cfg.vocab_size * 4 * 2,
        "activations": batch * t * cfg.hidden_size * act_bytes * 16,
    }
    if dcfg is not None:
        out["draft attention scores"] = b_local * dcfg.num_attention_heads * t * capacity * (4 + act_bytes)
        if paged:
            per_position = (dcfg.kv_lora_rank + dcfg.qk_rope_head_dim if dcfg.attention == "mla" else
                            2 * dcfg.num_key_value_heads * dcfg.head_dim)
            out["draft cache pages read contiguous"] = b_local * capacity * per_position * act_bytes
    return out


def prefill_working_bytes(cfg: TextConfig, dcfg: DraftConfig | None, mesh, batch: int, prompt: int, capacity: int,
                          experts_local: int, act_bytes: int = 2) -> dict[str, int]:
    """Largest transient buffers of one prefill chunk of `prompt` tokens (the engine runs longer prompts in
    chunks, `Engine(prefill_chunk=...)`), per device: [chunk, S] attention scores over the whole cache, and the
    dense MoE path (every local expert dequantized, run on every token of the chunk)."""
    b_local = batch // _size(mesh, "batch", batch)
    heads = cfg.num_attention_heads // _size(mesh, "heads", cfg.num_attention_heads)
    f, h = cfg.moe_intermediate_size, cfg.hidden_size
    out = {
        "target attention scores": b_local * heads * prompt * capacity * (4 + act_bytes),
        "local experts dequantized": experts_local * 3 * f * h * act_bytes,
        "expert activations": batch * prompt * experts_local * f * act_bytes * 3,
        "activations": batch * prompt * h * act_bytes * 16,
    }
    if dcfg is not None:
        out["draft attention scores"] = b_local * dcfg.num_attention_heads * prompt * capacity * (4 + act_bytes)
    return out


# --- the plan ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    config: str
    draft: str | None
    experts: str
    mesh_shape: dict
    context: int
    batch: int
    num_steps: int
    device_memory: int
    target_weights: dict  # {(category, format): bytes per device}
    draft_weights: dict
    kv: dict  # {name: bytes per device}
    working: dict  # cycle working memory estimate
    prefill_max_chunk: int  # longest power-of-two prefill chunk that fits (0: none); prompts run in chunks

    @property
    def weights_total(self) -> int:
        return sum(self.target_weights.values()) + sum(self.draft_weights.values())

    @property
    def total(self) -> int:
        return self.weights_total + sum(self.kv.values()) + sum(self.working.values())

    @property
    def headroom(self) -> int:
        return self.device_memory - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0


def abstract_mesh(shape: tuple[int, int]) -> AbstractMesh:
    return AbstractMesh(tuple(shape), MESH_AXES)


def make_plan(config: str, devices: int, device_memory: int, context: int, batch: int, *, mesh_shape=None,
              draft: str | None = "default", experts: str | None = None, num_steps: int = DEFAULT_NUM_STEPS,
              prefix_cache_tokens: int = 0, cache_pages: int | None = None) -> Plan:
    cfg = known_config(config)
    if experts is None:
        experts = cfg.quant.method if cfg.quant else "bf16"
    if draft == "default":
        draft = DEFAULT_DRAFT.get(config)
    dcfg = known_draft_config(draft) if draft else None
    mesh_shape = mesh_shape or (1, devices)
    if mesh_shape[0] * mesh_shape[1] != devices:
        raise ValueError(f"mesh {mesh_shape[0]}x{mesh_shape[1]} does not have {devices} devices")
    mesh = abstract_mesh(mesh_shape)

    target = bytes_by_category(abstract_target(cfg, experts), mesh, TARGET_RULES)
    draft_w = {} if dcfg is None else bytes_by_category(abstract_draft(dcfg), mesh, DRAFT_RULES)
    capacity = round_capacity(context)  # what the engine allocates for a context this long
    # the server's paged caches (--cache-pages): one pool for every slot, the target's and the draft's alike
    target_cache, draft_cache = abstract_caches(cfg, dcfg, batch, capacity, cache_pages=cache_pages)
    kv = {  # each under its field's name, which the rules match (`latent.3`), as in the engine's state
        "target latent (MLA, 512/token/layer)": bytes_per_device({"latent": target_cache.latent}, mesh, CACHE_RULES),
        "target rope key (64/token/layer)": bytes_per_device({"k_rope": target_cache.k_rope}, mesh, CACHE_RULES),
    }
    if draft_cache is not None:
        kv["draft KV cache"] = bytes_per_device(draft_cache, mesh, CACHE_RULES)
    pages = prefix_cache_tokens // PAGE_TOKENS
    if pages:  # the server's prefix cache: whole pages of every cache, held by every device (no rule splits them)
        pool_target, pool_draft = abstract_caches(cfg, dcfg, 1, pages * PAGE_TOKENS)
        kv[f"prefix cache ({pages} pages of {PAGE_TOKENS})"] = bytes_per_device(
            (pool_target.latent, pool_target.k_rope, pool_draft), mesh, ())
    working = cycle_working_bytes(cfg, dcfg, mesh, batch, capacity, num_steps, paged=cache_pages is not None)

    fixed = sum(target.values()) + sum(draft_w.values()) + sum(kv.values())
    experts_local = cfg.n_routed_experts // _size(mesh, "experts", cfg.n_routed_experts) if cfg.n_routed_experts else 0
    prompt, best = MIN_BUCKET, 0
    while prompt <= longest_chunk(context):
        need = fixed + sum(prefill_working_bytes(cfg, dcfg, mesh, batch, prompt, capacity, experts_local).values())
        if need > device_memory:
            break
        best, prompt = prompt, prompt * 2
    return Plan(config, draft, experts, dict(zip(MESH_AXES, mesh_shape)), context, batch, num_steps, device_memory,
                target, draft_w, kv, working, best)


def longest_chunk(context: int) -> int:
    """The chunk a prompt filling `context` runs in unchunked: its power-of-two bucket, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (context - 1).bit_length())


# --- printing ---------------------------------------------------------------------------------------------
def _gb(n: int) -> str:
    return f"{n / GB:9.3f}"


def _weight_table(title: str, table: dict) -> list[str]:
    formats = [f for f in FORMATS if any(fmt == f for _, fmt in table)]
    cats = [c for c in (*WEIGHT_CATEGORIES, "other") if any(cat == c for cat, _ in table)]
    lines = [f"{title:<24}" + "".join(f"{f:>13}" for f in formats) + f"{'total':>13}"]
    for c in cats:
        row = [table.get((c, f), 0) for f in formats]
        cells = "".join(f"{_gb(n):>13}" if n else f"{'-':>13}" for n in row)
        lines.append(f"  {c:<22}{cells}{_gb(sum(row)):>13}")
    per_format = [sum(n for (_, f), n in table.items() if f == fmt) for fmt in formats]
    lines.append(f"  {'total':<22}" + "".join(f"{_gb(n):>13}" for n in per_format) + f"{_gb(sum(per_format)):>13}")
    return lines


def format_plan(p: Plan) -> str:
    mesh = " x ".join(f"{a}={n}" for a, n in p.mesh_shape.items())
    lines = [
        f"jaxspec plan: {p.config} (routed experts {p.experts}) + draft {p.draft or 'none'}",
        f"mesh {mesh} ({math.prod(p.mesh_shape.values())} devices), context {p.context}, batch {p.batch}, "
        f"K={p.num_steps} draft tokens; bytes per device, GB = 1e9 bytes",
        "",
        *_weight_table("target weights", p.target_weights),
    ]
    if p.draft_weights:
        lines += ["", *_weight_table("draft weights (replicated)", p.draft_weights)]
    lines += ["", "KV caches"]
    lines += [f"  {name:<40}{_gb(n)}" for name, n in p.kv.items()]
    lines += [f"  {'total':<40}{_gb(sum(p.kv.values()))}", "",
              f"working memory, speculative cycle (estimate, T = K+1 = {p.num_steps + 1})"]
    lines += [f"  {name:<40}{_gb(n)}" for name, n in p.working.items()]
    lines += [f"  {'total':<40}{_gb(sum(p.working.values()))}", ""]
    lines += [
        f"{'weights':<42}{_gb(p.weights_total)}",
        f"{'KV caches':<42}{_gb(sum(p.kv.values()))}",
        f"{'working memory':<42}{_gb(sum(p.working.values()))}",
        f"{'total per device':<42}{_gb(p.total)}",
        f"{'device memory':<42}{_gb(p.device_memory)}",
        f"{'FITS' if p.fits else 'DOES NOT FIT'}: {'headroom' if p.fits else 'short by'} "
        f"{abs(p.headroom) / GB:.3f} GB ({100 * p.total / p.device_memory:.1f}% of the device used)",
    ]
    if p.fits:
        lines += [
            f"JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of the device (default 0.75): needs >= "
            f"{math.ceil(100 * p.total / p.device_memory) / 100:.2f}",
            (f"prefill fits chunks up to {p.prefill_max_chunk} tokens (estimate: [chunk, S] attention scores over "
             f"the whole cache); the engine's default chunk of {DEFAULT_CHUNK} "
             + ("fits" if p.prefill_max_chunk >= min(DEFAULT_CHUNK, longest_chunk(p.context)) else
                f"does not: pass Engine(prefill_chunk=...) / --prefill-chunk <= {p.prefill_max_chunk}"))
            if p.prefill_max_chunk else
            (f"no prefill chunk fits, not even the smallest ({MIN_BUCKET} tokens; estimate: [chunk, S] attention "
             "scores over the whole cache): the prompt cannot be run"),
        ]
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)  # 1.5e11 too
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 141GB, 80GiB, 1.5e11)")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def parse_mesh(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"mesh must look like 1x8 (data x model), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m jaxspec.plan", description=__doc__.split("\n")[0],
                      formatter_class=DefaultsHelpFormatter)
    p.add_argument("--config", default="kimi-k2.5", choices=KNOWN, help="target model configuration")
    p.add_argument("--draft", default="default",
                   help=f"draft config ({', '.join(KNOWN_DRAFTS)}), 'none', or 'default': the drafter published for "
                        "--config")
    p.add_argument("--experts", choices=("int4", "fp8", "bf16"), default=None,
                   help="routed expert storage (default: the checkpoint's)")
    p.add_argument("--devices", type=int, default=8, help="devices the model is split over")
    p.add_argument("--mesh", type=parse_mesh, default=None, help="data x model, e.g. 1x8 (default 1xDEVICES)")
    p.add_argument("--device-memory", type=parse_bytes, default="141GB",
                   help="memory of one device (GB = 10**9 bytes, GiB = 2**30)")
    p.add_argument("--context", type=int, default=131072,
                   help="tokens per sequence (prompt + new); caches are sized as the engine rounds them")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--prefix-cache-tokens", type=int, default=0,
                   help="the server's prefix cache (python -m jaxspec.serve: --max-context's worth unless told)")
    p.add_argument("--cache-pages", type=int, default=None,
                   help="the server's paged caches (python -m jaxspec.serve --cache-pages): pages of 64 "
                        "positions for all sequences together, in place of batch x context, for the target's "
                        "cache and the draft's")
    p.add_argument("--num-steps", type=int, default=DEFAULT_NUM_STEPS,
                   help="draft tokens per cycle K (the default K of python -m jaxspec.generate)")
    return p




def main(argv=None) -> int:
    """Prints the plan; 0 where it fits, 1 where it does not, 2 with one line `error: ...` for a bad flag."""
    return run_with_exit_codes(lambda: _plan(argv), (ValueError,))


def _plan(argv) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    # below these the planner divides by zero, or counts negative bytes into a plan that "fits"
    require_at_least(a, 1, "devices", "batch", "context", "cache_pages", "device_memory")
    require_at_least(a, 0, "num_steps", "prefix_cache_tokens")
    plan = make_plan(a.config, a.devices, a.device_memory, a.context, a.batch, mesh_shape=a.mesh,
                     draft=None if a.draft == "none" else a.draft, experts=a.experts, num_steps=a.num_steps,
                     prefix_cache_tokens=a.prefix_cache_tokens, cache_pages=a.cache_pages)
    print(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
