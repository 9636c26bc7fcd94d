"""Lab: a decode layer's attention input (input RMSNorm, q_a and kv_a projections, their two norms) at T = 1 in
four formulations, each timed in a device loop beside the launches XLA compiles it to (not yet run on a GPU).

Why: at depth a decode layer pays ~18 launch-bound small kernels (`bench.depth_gap_hlo`), and this block holds
nine launches: the input norm's mean and scale, the q_a GEMM (split over K) and its sum, the kv_a GEMV (run as a
reduction), and the two LoRA norms' means and scales. A Pallas kernel that fused the norms lost (each launch took
longer than XLA's, docs/performance.md); these variants only rewrite the math for XLA:
- `plain`: as model.attention_mla computes it;
- `one_weight`: q_a and kv_a as one [Q + C + R, H] weight (concatenated once, as a loader would), one GEMM;
- `scale_after`: the input norm's per-row 1 / rms applied to the GEMMs' outputs, ((x * g) @ W.T) * r, so the
  normalised x is never written (XLA may take x * g into the GEMM's prologue and r into its epilogue);
- `one_weight_scale_after`: both.
Each variant's outputs are held to `plain`'s (max relative error). Run: `python -m bench.labs.attention_input_lab
--out DIR` (`--tiny` on a CPU: a smoke run, not a timing).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import bench  # noqa: F401  (the engine's XLA flags)
from bench.report import write_json
from bench.timing import device_loop_ms
from model.norms import rms_norm

EPS, LORA_EPS = 1e-5, 1e-6  # Kimi's rms_norm_eps; the LoRA norms' (model.attention_mla.LORA_NORM_EPS)
K25 = dict(h=7168, q=1536, c=512, r=64)
TINY = dict(h=256, q=64, c=32, r=16)


def draw(dims: dict, key) -> tuple[dict, jax.Array]:
    """Random weights of the block (with q_a and kv_a also as one weight, concatenated once as a loader would) and
    one token's hidden state x [1, 1, H]."""
    ks = jax.random.split(key, 6)
    h, q, c, r = dims["h"], dims["q"], dims["c"], dims["r"]
    bf = jnp.bfloat16
    w = {"input_norm": (1 + 0.1 * jax.random.normal(ks[0], (h,))).astype(bf),
         "q_a": (jax.random.normal(ks[1], (q, h)) * h ** -0.5).astype(bf),
         "kv_a": (jax.random.normal(ks[2], (c + r, h)) * h ** -0.5).astype(bf),
         "q_a_norm": (1 + 0.1 * jax.random.normal(ks[3], (q,))).astype(bf),
         "kv_a_norm": (1 + 0.1 * jax.random.normal(ks[4], (c,))).astype(bf)}
    w["qkv_a"] = jnp.concatenate([w["q_a"], w["kv_a"]], axis=0)
    return w, jax.random.normal(ks[5], (1, 1, h)).astype(bf)


def _lora_outputs(q_BTQ, kv_BTX, w, c):
    return rms_norm(q_BTQ, w["q_a_norm"], LORA_EPS), rms_norm(kv_BTX[..., :c], w["kv_a_norm"], LORA_EPS), \
        kv_BTX[..., c:]


def _projections(x_BTH, w, one_weight: bool, scale_after: bool):
    """(q_a output, kv_a output) of the input-normed x."""
    if scale_after:
        x32 = x_BTH.astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)
        h = w["input_norm"] * x_BTH
    else:
        h = rms_norm(x_BTH, w["input_norm"], EPS)
    if one_weight:
        both = jnp.einsum("...i,oi->...o", h, w["qkv_a"])
        q, kv = both[..., : w["q_a"].shape[0]], both[..., w["q_a"].shape[0]:]
    else:
        q, kv = jnp.einsum("...i,oi->...o", h, w["q_a"]), jnp.einsum("...i,oi->...o", h, w["kv_a"])
    if scale_after:
        q, kv = (q.astype(jnp.float32) * r).astype(x_BTH.dtype), (kv.astype(jnp.float32) * r).astype(x_BTH.dtype)
    return q, kv


VARIANTS = {"plain": (False, False), "one_weight": (True, False), "scale_after": (False, True),
            "one_weight_scale_after": (True, True)}


def attention_input(x_BTH, w, variant: str):
    """(normed q_a output [B, T, Q], latent [B, T, C], k_pe [B, T, R]) under `variant`."""
    q, kv = _projections(x_BTH, w, *VARIANTS[variant])
    return _lora_outputs(q, kv, w, w["kv_a_norm"].shape[0])


def make_loop(w, variant: str):
    """n steps in one jitted loop; each step's x takes a zero-weighted term of the last step's outputs, so XLA can
    neither hoist the block out of the loop nor drop it."""
    @jax.jit
    def loop(x_BTH, n):
        def body(_, x):
            q, latent, k_pe = attention_input(x, w, variant)
            tie = q[..., :1] * 0 + latent[..., :1] * 0 + k_pe[..., :1] * 0
            return x + tie.astype(x.dtype)
        return jax.lax.fori_loop(0, n, body, x_BTH)
    return loop


def launches(compiled_text: str) -> int:
    """Kernels a program launches, counted as its fusions and custom calls (the loop's own bookkeeping included)."""
    return compiled_text.count(" fusion(") + compiled_text.count(" custom-call(")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.labs.attention_input_lab", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="small dims (a CPU smoke run)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    if args.steps < 1 or args.iters < 1:
        raise SystemExit("--steps and --iters must be >= 1")
    dims = TINY if args.tiny else K25
    w, x = draw(dims, jax.random.PRNGKey(0))
    ref = jax.jit(lambda x: attention_input(x, w, "plain"))(x)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": now.isoformat(timespec="seconds"),
              "dims": dims, "steps": args.steps, "rows": []}
    for variant in VARIANTS:
        out = jax.jit(lambda x, v=variant: attention_input(x, w, v))(x)
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                        / (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-30)) for a, b in zip(out, ref))
        loop = make_loop(w, variant)
        n_launch = launches(loop.lower(x, jnp.int32(args.steps)).compile().as_text())
        timing = device_loop_ms(lambda n, loop=loop: loop(x, jnp.int32(n)), args.steps, args.iters)
        row = {"variant": variant, "max_rel_err": err, "launches": n_launch, **timing}
        result["rows"].append(row)
        print(f"{variant:24s} {1e3 * row['device_loop_ms']:8.1f} us a step  {n_launch:3d} launches in the program  "
              f"max rel err {err:.1e}", flush=True)
    path = write_json(result, args.out, f"attention-input-{jax.default_backend()}-{now.strftime('%Y%m%d-%H%M')}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
