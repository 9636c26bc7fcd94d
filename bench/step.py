"""`python -m bench.step`: a Kimi-K2.5-shaped model of N layers (real dims, INT4 experts, random weights)
timed for decode (T=1), verify (T=2..8) and the full speculative cycle (K=1..4), against byte floors.

Per configuration: median of device-synchronised step times after warm-up (and the mean when steps are
queued back to back), the bytes the step must move (the unique routed experts come from that very step's
router ids), the floor at 4.3 TB/s and at the copy bandwidth measured in this run, and the ratios.
Writes bench/results/step-<device>-<date>.json and .md (or --out).

`--prefix-layers M` also times the target configuration's kernel steps on the model's first M layers (the same
weights, tokens and cache): the difference is the N - M MoE layers alone, inside a step, against their own bytes,
without the lm_head that is half of a 4-layer step's bytes (`layer_slope` in the JSON).

`--mesh 8` (or 2x4) runs the steps sharded as the engine shards them, for the full model on 8 GPUs (issue 9):
`python -m bench.step --layers 61 --mesh 8 --batches 1 --tokens 1 2 3 4 5 --contexts 1024 32768`; it adds the
all-reduce latency and per-device floors.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory to the PyTorch peer

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bytes_floor import HBM_TBS, floor_ms, step_bytes, unique_experts_per_layer  # noqa: E402
from bench.routes import NEIGHBOUR_SHARE, ROUTINGS, regime_routes  # noqa: E402
from bench.report import run_stamp, write_report  # noqa: E402
from bench.timing import copy_bandwidth_tbs, device_loop_ms, median_ms, read_bandwidth_tbs  # noqa: E402
from model.configs import known_config  # noqa: E402
from model.decoder import forward, fuse_attention_inputs  # noqa: E402
from model.init import init_kimi_weights  # noqa: E402
from model.config import KERNEL_CHOICES, Kernels  # noqa: E402
from model.kernels.dispatch import moe_kernel_for, triton_config_for, wgmma_config_for  # noqa: E402
from model.kv_cache import LatentCache, round_capacity  # noqa: E402
from model.sharding import (CACHE_RULES, TARGET_RULES, make_mesh, mesh_context, parse_mesh_spec,  # noqa: E402
                            shardings_for)
from model.moe import MoEWeights  # noqa: E402

TINY_DIMS = dict(hidden_size=256, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, intermediate_size=512, moe_intermediate_size=64,
                 n_routed_experts=16, num_experts_per_tok=4, vocab_size=1024)


def bench_config(layers: int, tiny: bool):
    cfg = known_config("kimi-k2.5")
    if tiny:
        cfg = cfg.replace(**TINY_DIMS)
    # three distinct residual taps inside N layers feed the draft (the EAGLE-3 default needs N > 4)
    aux = (0, 1, 2) if layers <= 3 else (1, layers // 2, layers - 1)
    return cfg.replace(num_hidden_layers=layers, aux_layer_ids=aux)


# one compiled program draws every weight on device (eager init compiles and dispatches op by op)
init_weights = jax.jit(init_kimi_weights, static_argnums=(0,), static_argnames=("dtype", "experts"))


def draw_weights(cfg, tiny: bool, experts: str = "int4", mesh=None, moe_layers: str = "distinct"):
    """Random weights for `cfg`, waited for. A tiny model is drawn by numpy on the host (nothing to compile: the
    jitted init compiles for ~10 s at -O0 on a CPU); a full-size one in one jitted program on device, or straight
    into its shards over `mesh` (a full-size model never sits on one device).

    `moe_layers="repeated"`: one MoE layer is drawn and every MoE layer runs on its arrays. Drawing grows with the
    layers (K2.5's routed experts are 8.4 GB a layer), so this takes a fraction of the time at depth, and each layer
    still reads its own ~0.5 GB from memory at T = 1, ten times the L2 cache, so what a step reads is unchanged."""
    if moe_layers == "repeated":
        first = cfg.first_k_dense_replace
        one = draw_weights(cfg.replace(num_hidden_layers=first + 1, aux_layer_ids=None), tiny, experts, mesh)
        return one.replace(layers=one.layers + (one.layers[-1],) * (cfg.num_hidden_layers - first - 1))
    if tiny:
        w = init_kimi_weights(cfg, np.random.default_rng(0), experts=experts)
        if mesh is not None:
            w = jax.device_put(w, shardings_for(jax.eval_shape(lambda: w), mesh, TARGET_RULES))
    elif mesh is None:
        w = init_weights(cfg, jax.random.PRNGKey(0), experts=experts)
    else:
        w = init_sharded_weights(cfg, jax.random.PRNGKey(0), mesh, experts)
    return jax.block_until_ready(w)


def random_model(layers: int, tiny: bool):
    """`bench_config` and its random INT4-expert weights (`draw_weights`): (cfg, weights)."""
    cfg = bench_config(layers, tiny)
    return cfg, draw_weights(cfg, tiny)


def _kernel_record(tokens: int, experts, cfg) -> dict:
    """The MoE kernel the engine dispatches to at this many tokens, and its settings."""
    variant = moe_kernel_for(tokens, experts, cfg.kernels)
    if variant in ("wgmma", "grouped"):
        return {"variant": variant, **wgmma_config_for(experts, cfg.num_experts_per_tok, tokens)}
    return triton_config_for(tokens, experts).__dict__


# the two paths every benchmark compares: the engine's kernels as dispatched, and the plain XLA routed experts
PATH_KERNELS = {"kernel": Kernels(), "reference": Kernels(moe="off")}
# what --moe-kernel may name for the kernel path (the reference path is the "off" one)
KERNEL_PATH_MOE = tuple(c for c in KERNEL_CHOICES["moe"] if c != "off")


def step_routes(cfg, routing: str, tokens_BT):
    """`forward`'s `expert_ids` for `routing` at these tokens (`bench.routes.regime_routes`; None for "model")."""
    b, t = tokens_BT.shape
    return regime_routes(routing, b, t, cfg.num_hidden_layers - cfg.first_k_dense_replace, cfg.n_routed_experts,
                         cfg.num_experts_per_tok)


def make_step(cfg, kernels: Kernels, routing: str = "model"):
    """Jitted target forward under `kernels` (cache donated) returning logits, the cache and the expert ids of
    each MoE layer [L, B*T, K]; `routing` other than "model" sets the ids (`bench.routes.regime_routes`, per row of T
    tokens)."""
    cfg = cfg.replace(kernels=kernels)

    def step(w, tokens_BT, positions_BT, cache):
        out = forward(w, cfg, tokens_BT, positions_BT, cache, expert_ids=step_routes(cfg, routing, tokens_BT))
        return out.logits, out.cache, jnp.stack(out.expert_ids)

    return jax.jit(step, donate_argnums=(3,))


def make_step_loop(cfg, kernels: Kernels, routing: str = "model"):
    """`steps` (an argument: one program for every length) decode/verify steps in one jitted device loop, each fed
    the previous step's argmax tokens (as the engine's on-device generation is): the per-step time without a host
    round trip per step."""
    cfg = cfg.replace(kernels=kernels)

    def loop(w, tokens_BT, positions_BT, cache, steps):
        expert_ids = step_routes(cfg, routing, tokens_BT)

        def body(_, carry):
            toks, c = carry
            out = forward(w, cfg, toks, positions_BT, c, expert_ids=expert_ids)
            return jnp.argmax(out.logits, axis=-1).astype(toks.dtype), out.cache

        return jax.lax.fori_loop(0, steps, body, (tokens_BT, cache))

    return jax.jit(loop, donate_argnums=(3,))


def random_cache(cfg, batch: int, capacity: int, context: int, key, dtype=jnp.bfloat16) -> LatentCache:
    keys = jax.random.split(key, 2 * cfg.num_hidden_layers)
    rnd = lambda k, d: jax.random.normal(k, (batch, capacity, d), jnp.float32).astype(dtype)  # noqa: E731
    n = cfg.num_hidden_layers
    return LatentCache(
        latent=tuple(rnd(keys[i], cfg.kv_lora_rank) for i in range(n)),
        k_rope=tuple(rnd(keys[n + i], cfg.qk_rope_head_dim) for i in range(n)),
        lengths=jnp.full((batch,), context, jnp.int32),
    )


def step_inputs(cfg, batch: int, tokens: int, context: int, key) -> tuple[jax.Array, jax.Array]:
    """Random token ids [B, T] and their positions context.. (the slots a step writes after `context` tokens)."""
    tokens_BT = jax.random.randint(key, (batch, tokens), 0, cfg.vocab_size, jnp.int32)
    positions_BT = jnp.broadcast_to(context + jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    return tokens_BT, positions_BT


def time_step(w, cfg, step_fn, batch: int, tokens: int, context: int, key, iters: int, copy_tbs: float,
              loop_fn=None, loop_steps: int = 0, mesh=None) -> dict:
    cache = random_cache(cfg, batch, round_capacity(context + 16), context, key)
    if mesh is not None:  # the cache over "data", as the engine lays it out
        cache = jax.device_put(cache, shardings_for(cache, mesh, CACHE_RULES))
    tokens_BT, positions_BT = step_inputs(cfg, batch, tokens, context, key)
    t0 = time.perf_counter()
    logits, cache, ids_LTK = step_fn(w, tokens_BT, positions_BT, cache)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t0
    holder = {"cache": cache}

    def run():
        out, holder["cache"], _ = step_fn(w, tokens_BT, positions_BT, holder["cache"])
        return out

    stats = median_ms(run, warmup=3, iters=iters)
    if loop_fn is not None:  # the same step inside one jitted loop, `loop_steps` and 3 x `loop_steps` at a time
        def run_loop(steps):
            out, holder["cache"] = loop_fn(w, tokens_BT, positions_BT, holder["cache"], jnp.int32(steps))
            return out

        stats.update(device_loop_ms(run_loop, loop_steps, iters))
    unique = unique_experts_per_layer(np.asarray(ids_LTK))
    parts = step_bytes(w, cfg, batch, tokens, context, unique)
    del holder
    if "device_loop_ms" in stats:
        stats["device_loop_ratio_4p3"] = stats["device_loop_ms"] / floor_ms(parts["total"], HBM_TBS)
    if mesh is not None:  # an ideal split of the bytes over the devices (replicated pieces make it optimistic)
        stats["floor_ms_per_device"] = floor_ms(parts["total"], HBM_TBS) / mesh.size
        stats["ratio_per_device"] = stats["median_ms"] / stats["floor_ms_per_device"]
    return dict(batch=batch, tokens=tokens, context=context, compile_s=compile_s, **stats,
                unique_experts=unique, bytes=parts,
                floor_ms_4p3=floor_ms(parts["total"], HBM_TBS), floor_ms_copy=floor_ms(parts["total"], copy_tbs),
                ratio_4p3=stats["median_ms"] / floor_ms(parts["total"], HBM_TBS),
                ratio_copy=stats["median_ms"] / floor_ms(parts["total"], copy_tbs))


def check_prefix_layers(cfg, layers: int) -> None:
    """The layers a prefix leaves out must all be MoE layers, and at least one."""
    if not cfg.first_k_dense_replace <= layers < cfg.num_hidden_layers:
        raise SystemExit(f"--prefix-layers must be between {cfg.first_k_dense_replace} (the dense layers) and "
                         f"{cfg.num_hidden_layers - 1} (--layers - 1), not {layers}")


def prefix_model(w, cfg, layers: int, kernels: Kernels, routing: str = "model"):
    """The first `layers` layers of `w` (the same arrays) with their config, step and device loop (a set routing
    draws the same ids for these layers as for the full model's first layers)."""
    check_prefix_layers(cfg, layers)
    pcfg = cfg.replace(num_hidden_layers=layers,
                       aux_layer_ids=tuple(i for i in cfg.eagle_aux_layers if i < layers) or (0,))
    pw = dataclasses.replace(w, layers=w.layers[:layers])
    return dict(w=pw, cfg=pcfg, step=make_step(pcfg, kernels, routing), loop=make_step_loop(pcfg, kernels, routing))


def layer_slope(full: dict, prefix: dict, layers: int, prefix_layers: int) -> dict:
    """Per MoE layer: (the N-layer step - its M-layer prefix) / (N - M), times and bytes (same tokens and cache)."""
    n = layers - prefix_layers
    per = lambda k: (full[k] - prefix[k]) / n if k in full and k in prefix else None  # noqa: E731
    floor = (full["floor_ms_4p3"] - prefix["floor_ms_4p3"]) / n
    row = dict(batch=full["batch"], context=full["context"], tokens=full["tokens"], layers=layers,
               prefix_layers=prefix_layers, median_ms=per("median_ms"), queued_ms=per("queued_mean_ms"),
               device_loop_ms=per("device_loop_ms"), floor_ms_4p3=floor,
               bytes=(full["bytes"]["total"] - prefix["bytes"]["total"]) / n,
               unique_experts=full["unique_experts"][len(prefix["unique_experts"]):], prefix_row=prefix)
    for k in ("median_ms", "queued_ms", "device_loop_ms"):
        row[f"{k[:-3]}_ratio_4p3"] = row[k] / floor if row[k] is not None else None
    return row


def run_steps(result, w, cfg, steps, plan, args, copy_tbs, over_budget, save, log, loops, mesh=None, prefix=None,
              routing: str = "model"):
    """Times each (path, batch, context, tokens) of `plan` (its steps routed by `routing`); with `prefix`
    (`prefix_model`), the kernel path's rows at the first batch / context also on the prefix, with the same key
    (tokens, cache), into `layer_slope`."""
    key = jax.random.PRNGKey(len(result["steps"]) + 1)
    for path, b, c, t in plan:
        if over_budget():
            result["skipped"].append(f"step {path} B={b} ctx={c} T={t} routing {routing}")
            continue
        key, sub = jax.random.split(key)
        loop = None
        if args.loop_steps and (b, c) == (args.batches[0], args.contexts[0]):  # the targets' configuration
            loop = make_step_loop(cfg, loops[path], routing)
        try:
            row = time_step(w, cfg, steps[path], b, t, c, sub, args.iters, copy_tbs, loop, args.loop_steps, mesh)
            row["moe_path"], row["routing"] = path, routing
            result["steps"].append(row)
            loop_note = (f", device loop {row['device_loop_ms']:.3f} + {row['device_loop_fixed_ms']:.3f} a loop "
                         f"(loop / N {row['device_loop_chained_ms']:.3f})") if "device_loop_ms" in row else ""
            log(f"step {path:9s} B={b} ctx={c:6d} T={t} routing {routing}: {row['median_ms']:.3f} ms "
                f"(queued {row['queued_mean_ms']:.3f}{loop_note}), floor {row['floor_ms_4p3']:.3f} ms, ratio {row['ratio_4p3']:.2f}, "
                f"unique experts {np.mean(row['unique_experts']):.1f}, compile {row['compile_s']:.1f} s")
            if prefix is not None and path == prefix["path"] and (b, c) == (args.batches[0], args.contexts[0]):
                pre = time_step(prefix["w"], prefix["cfg"], prefix["step"], b, t, c, sub, args.iters, copy_tbs,
                                loop and prefix["loop"], args.loop_steps)
                slope = layer_slope(row, pre, cfg.num_hidden_layers, prefix["cfg"].num_hidden_layers)
                slope["routing"] = routing
                result.setdefault("layer_slope", []).append(slope)
                loop_part = (f", device loop {slope['device_loop_ms'] * 1e3:.1f} ({slope['device_loop_ratio_4p3']:.2f}x)"
                             if slope["device_loop_ms"] is not None else "")
                log(f"  one MoE layer in the step (layers {slope['prefix_layers']}..{slope['layers'] - 1}): "
                    f"{slope['median_ms'] * 1e3:.1f} us synchronised ({slope['median_ratio_4p3']:.2f}x), queued "
                    f"{slope['queued_ms'] * 1e3:.1f}{loop_part}, floor {slope['floor_ms_4p3'] * 1e3:.1f} us")
        except Exception as e:
            result["errors"].append(f"step {path} B={b} ctx={c} T={t} routing {routing}: {type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
        save()


def step_plan(batches, contexts, tokens_list):
    """Most important first, so a run cut short by its time budget still shows the targets."""
    plan = []
    for b in batches:
        for c in contexts:
            for t in sorted(tokens_list, key=lambda t: (t not in (1, 4), t)):
                plan.append((b, c, t))
    return plan


def mesh_shape(text: str) -> tuple[int, int]:
    try:
        return parse_mesh_spec(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh must look like 8 or 2x4 (data x model), got {text!r}") from None


def init_sharded_weights(cfg, key, mesh, experts: str = "int4"):
    """Random weights drawn straight into their shards (a full-size model never sits on one device)."""
    draw = lambda k: init_kimi_weights(cfg, k, experts=experts)  # noqa: E731
    return jax.jit(draw, out_shardings=shardings_for(jax.eval_shape(draw, key), mesh, TARGET_RULES))(key)


def allreduce_us(mesh, rows: int, hidden: int, reps: int = 20, iters: int = 10) -> float:
    """Median latency of one all-reduce (psum over "model") of a [rows, hidden] bf16 activation, as each layer's
    attention and MLP outputs need: `reps` chained inside one jit."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from model.shard_local import shard_map_unchecked

    n = mesh.shape["model"]
    add = shard_map_unchecked(lambda a: jax.lax.psum(a, "model"), mesh, in_specs=P("model"), out_specs=P("model"))
    x = jax.device_put(jnp.ones((n * rows, hidden), jnp.bfloat16), NamedSharding(mesh, P("model")))
    run = jax.jit(lambda x: jax.lax.fori_loop(0, reps, lambda _, a: (add(a) * (1.0 / n)).astype(a.dtype), x))
    return median_ms(lambda: run(x), warmup=2, iters=iters)["median_ms"] * 1e3 / reps


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="target layers (first dense, rest MoE)")
    p.add_argument("--tiny", action="store_true", help="small dims for a CPU smoke run")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    p.add_argument("--cycle-k", type=int, nargs="*", default=[1, 2, 3, 4])
    p.add_argument("--draft-kinds", nargs="+", choices=("llama", "mla"), default=["llama"],
                   help="draft layers timed in the cycles: llama (LlamaForCausalLMEagle3) and / or mla "
                        "(Eagle3DeepseekV2ForCausalLM, EAGLE-3.1, the target's attention shape)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--loop-steps", type=int, default=10,
                   help="also time steps inside one jitted loop, this many and 3x as many (the per-step time is "
                        "the slope; first batch/context only; 0 = off)")
    p.add_argument("--prefix-layers", type=int, default=0,
                   help="also time the first batch/context's kernel steps on the first M layers: the difference is "
                        "one MoE layer inside the step (0 = off)")
    p.add_argument("--routing", choices=ROUTINGS, nargs="+", default=["model"],
                   help="the steps' expert choices, each in turn over the same weights: the random model's router "
                        "(model), or set by bench per row of T "
                        "tokens: independent at random, neighbour (each choice repeats one of the previous token's "
                        f"with probability {NEIGHBOUR_SHARE}), shared (a row's tokens choose the same experts); the "
                        "cycles keep the model's router")
    p.add_argument("--moe-kernel", choices=KERNEL_PATH_MOE, default="auto",
                   help="the kernel path's routed experts (model.config.Kernels.moe): grouped converts an expert "
                        "several verify slots chose once")
    p.add_argument("--attention-input", choices=("fused", "separate"), default="fused",
                   help="q_a and kv_a as one weight, as the engines run them (jaxspec.sharded.weights_to_run), or "
                        "as two (the layout checkpoints store)")
    p.add_argument("--moe-layers", choices=("distinct", "repeated"), default="distinct",
                   help="repeated: one MoE layer's random weights used by every MoE layer (bench.step.draw_weights: "
                        "a fraction of the drawing time at depth, the same bytes read per step)")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new configurations after this")
    p.add_argument("--skip-moe-layer", action="store_true")
    p.add_argument("--skip-reference", action="store_true",
                   help="no XLA reference-path rows beside the kernel's (deep models: the reference gathers the "
                        "chosen experts' dequantised weights, tens of GB at T = 4 and 10 layers)")
    p.add_argument("--mesh", type=mesh_shape, default=None,
                   help="data x model (1x8) or a device count: weights by the partition rules (experts over every "
                        "device), caches over data, steps and cycles traced in the mesh (the one-device MoE lab is "
                        "skipped); measures the all-reduce latency too")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args(argv)
    # checked before anything runs: each of these would otherwise time nothing (a median of no calls, a step of no
    # tokens) or fail in every row, and still write a result that looks complete
    dense = known_config("kimi-k2.5").first_k_dense_replace
    if a.layers <= dense:
        p.error(f"--layers must be > {dense} (the dense layers): the steps time the MoE layers, got {a.layers}")
    for flag, values, least in (("--iters", [a.iters], 1), ("--batches", a.batches, 1), ("--tokens", a.tokens, 1),
                                ("--contexts", a.contexts, 0), ("--cycle-k", a.cycle_k, 1),
                                ("--loop-steps", [a.loop_steps], 0), ("--prefix-layers", [a.prefix_layers], 0)):
        if any(v < least for v in values):
            p.error(f"{flag} must be >= {least}, got {' '.join(map(str, values))}")
    return a


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = bench_config(args.layers, args.tiny)
    if args.prefix_layers:
        check_prefix_layers(cfg, args.prefix_layers)
        if args.mesh:
            raise SystemExit("--prefix-layers runs on one device: leave out --mesh")
    t_start = time.time()
    over_budget = lambda: time.time() - t_start > args.budget_s  # noqa: E731
    log = functools.partial(print, flush=True)
    stamp = run_stamp()
    dev = stamp.device
    on_gpu = dev.platform == "gpu"
    result = dict(**stamp.fields,
                  xla_flags=os.environ.get("XLA_FLAGS", ""), layers=args.layers, tiny=args.tiny, args=vars(args),
                  skipped=[], errors=[])
    stem = f"step-{'tiny-' if args.tiny else ''}{stamp.suffix}"
    save = lambda: write_report(result, Path(args.out), stem)  # noqa: E731

    # off the GPU (a smoke run) a 10 MB probe: the CPU's unoptimised bf16 pass over 100 MB cost ~10 s of each run
    probe_gb = 4.0 if on_gpu else 0.01
    result["copy_tbs"] = copy_tbs = copy_bandwidth_tbs(gbytes=probe_gb)
    result["read_tbs"] = read_bandwidth_tbs(gbytes=probe_gb)
    log(f"device {dev.device_kind}, jax {jax.__version__}, copy bandwidth {copy_tbs:.2f} TB/s, "
        f"read bandwidth {result['read_tbs']:.2f} TB/s")

    mesh = make_mesh(args.mesh) if args.mesh else None
    t0 = time.perf_counter()
    w = draw_weights(cfg, args.tiny, mesh=mesh, moe_layers=args.moe_layers)
    if args.attention_input == "fused":
        w = fuse_attention_inputs(w)
    log(f"weights: {args.layers} layers ({args.moe_layers} MoE layers) in {time.perf_counter() - t0:.1f} s, attention "
        f"input {args.attention_input}")
    if mesh is not None:
        result["mesh"] = dict(zip(mesh.axis_names, mesh.devices.shape))
        result["allreduce_us"] = {f"T{t}": allreduce_us(mesh, max(args.batches) * t, cfg.hidden_size)
                                  for t in sorted(set(args.tokens))}
        # per step: attention out + MLP / MoE out per layer, and the lm_head's vocab shards
        result["allreduces_per_step"] = 2 * cfg.num_hidden_layers + 1
        log(f"mesh {result['mesh']}: all-reduce of [B*T, {cfg.hidden_size}] bf16 over 'model': "
            + ", ".join(f"{k} {v:.1f} us" for k, v in result["allreduce_us"].items()))
        result["skipped"].append("MoE layer lab (a one-device benchmark) under --mesh")
    moe_layer = next(lw.mlp for lw in w.layers if isinstance(lw.mlp, MoEWeights))

    kernel_ok = on_gpu  # the steps take the engine's own dispatch (model.kernels) unless the layer check fails
    if on_gpu and not args.skip_moe_layer and mesh is None:
        from bench.moe_layer import bench_bf16_kernel, bench_moe_layer

        try:
            result["moe_layer"], kernel_ok = bench_moe_layer(moe_layer, cfg, copy_tbs=copy_tbs, log=log,
                                                             iters=args.iters)
            result["moe_layer_bf16"] = bench_bf16_kernel(moe_layer, cfg, log=log, iters=args.iters)
        except Exception as e:
            result["errors"].append(f"moe_layer: {type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
        save()
    result["moe_path"] = "pallas kernel (model.kernels dispatch)" if kernel_ok else "plain XLA reference"
    path_kernels = {**PATH_KERNELS, "kernel": Kernels(moe=args.moe_kernel)}
    result["moe_kernel"] = args.moe_kernel
    kernel_cfg = cfg.replace(kernels=path_kernels["kernel"])
    result["kernel_config"] = {f"T{t}": _kernel_record(t, moe_layer.experts, kernel_cfg)
                               for t in sorted({b * t for b in args.batches for t in args.tokens})} if kernel_ok else {}
    log(f"MoE path for the steps: {result['moe_path']}" + (f", moe={args.moe_kernel}" if kernel_ok else ""))

    loops = {path: path_kernels[path] for path in (("reference", "kernel") if kernel_ok else ("reference",))}
    main_plan = [("kernel" if kernel_ok else "reference", b, c, t)
                 for b, c, t in step_plan(args.batches, args.contexts, args.tokens)]
    plan = list(main_plan)
    if kernel_ok and not args.skip_reference:  # the XLA reference path side by side, where the targets are
        plan[2:2] = [("reference", args.batches[0], args.contexts[0], t) for t in (1, 4) if t in args.tokens]
    result["steps"], result["cycles"] = [], []
    first = (args.batches[0], args.contexts[0])
    kernels = loops["kernel" if kernel_ok else "reference"]
    cycles = args.cycle_k and args.layers >= 3
    if cycles:
        from bench.cycle import bench_cycles
    for n, routing in enumerate(args.routing):
        # each routing its own programs over the same weights; the reference rows and the cycles (which keep the
        # model's router) once
        steps = {path: make_step(cfg, kernels, routing) for path, kernels in loops.items()}
        # one token per row draws its experts at random under every regime: T = 1 once
        todo = plan if n == 0 else [p for p in main_plan if p[3] > 1]
        run_cycles = cycles and n == 0
        prefix = None
        if args.prefix_layers:
            prefix = dict(prefix_model(w, cfg, args.prefix_layers, kernels, routing),
                          path="kernel" if kernel_ok else "reference")
        if mesh is not None:  # traced inside the mesh (the MoE finds it there): every step, then every cycle
            with mesh_context(mesh):
                run_steps(result, w, cfg, steps, todo, args, copy_tbs, over_budget, save, log, loops, mesh,
                          routing=routing)
                if run_cycles:
                    pairs = [(b, c) for b in args.batches for c in args.contexts]
                    result["cycles"] += bench_cycles(w, cfg, args, kernels, copy_tbs, over_budget, result, log, pairs,
                                                     tiny=args.tiny, mesh=mesh)
            continue
        # the targets' configuration first (steps, then cycles), so a run cut by its budget still shows them
        run_steps(result, w, cfg, steps, [p for p in todo if (p[1], p[2]) == first], args, copy_tbs, over_budget,
                  save, log, loops, prefix=prefix, routing=routing)
        if run_cycles:
            result["cycles"] += bench_cycles(w, cfg, args, kernels, copy_tbs, over_budget, result, log, [first],
                                             tiny=args.tiny, loop_cycles=args.loop_steps)
            save()
        run_steps(result, w, cfg, steps, [p for p in todo if (p[1], p[2]) != first], args, copy_tbs, over_budget,
                  save, log, loops, routing=routing)
        if run_cycles:
            rest = [(b, c) for b in args.batches for c in args.contexts if (b, c) != first]
            result["cycles"] += bench_cycles(w, cfg, args, kernels, copy_tbs, over_budget, result, log, rest,
                                             tiny=args.tiny)
            save()
    result["wall_s"] = time.time() - t_start
    path = save()
    log(f"wrote {path} and .md in {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
