"""GPU kernels, each beside the plain-XLA reference it is tested against.

`dispatch.py` maps (backend, shapes, `model.config.Kernels`) to an implementation; one file per kernel family
follows: moe_wgmma.py (Mosaic GPU routed experts, Hopper), moe_gemv.py / moe_gather.py (Triton routed experts, tiles
in moe_tiles.py), mla_decode.py (MLA attention over the latent cache), router_gemv.py / router_topk.py (routing).
This package imports only model.config, model.quant, model.kv_cache and model.sharding: the layers import it.
"""
