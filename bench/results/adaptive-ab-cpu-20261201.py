"""A/B on this CPU: plain decoding vs adaptive forced to K=0 vs adaptive forced K=1 vs fixed K=1, interleaved; min and median."""
import statistics, time, jax.numpy as jnp
from bench.adaptive_prompts import load_pair, encode, PROMPTS
from jaxspec.engine import Engine
from jaxspec.adaptive import AdaptivePolicy
cfg, w, tok = load_pair(jnp.bfloat16)
p = encode(tok, PROMPTS[2][1])
N = 48
engs = {
  "plain": (Engine(cfg, w, num_steps=1), False),
  "fixed K=1": (Engine(cfg, w, num_steps=1), True),
  "adaptive forced K=0": (Engine(cfg, w, num_steps=1, adaptive=AdaptivePolicy(costs=((0, 1.0), (1, 1.0)), schedule=(0,))), True),
  "adaptive forced K=1": (Engine(cfg, w, num_steps=1, adaptive=AdaptivePolicy(costs=((0, 1.0), (1, 1.0)), schedule=(1,))), True),
  "adaptive measured": (Engine(cfg, w, num_steps=1, adaptive=AdaptivePolicy()), True),
}
for n, (e, s) in engs.items():
    r = e.generate([p], N, speculative=s); print(n, "compiled", flush=True)
ms = {n: [] for n in engs}
for rnd in range(7):
    for n, (e, s) in engs.items():
        r = e.generate([p], N, speculative=s)
        ms[n].append(1000 * r.decode_s / (len(r.tokens[0]) - 1))
        if n == "adaptive measured" and rnd == 6:
            print("adaptive measured: K hist", r.adaptive.k_histogram, "costs ms", [round(1000*c, 2) for c in r.adaptive.costs_s], r.adaptive.cost_source)
for n, v in ms.items():
    print(f"{n}: ms/token min {min(v):.2f} median {statistics.median(v):.2f}")
