"""bench.depth_gap_hlo: kernels' roles from the optimized HLO, whatever their launch order (no device needed)."""

import gzip
import json

import pytest

from bench import depth_gap_hlo

HLO = """
  %gemm_fusion_dot.73 = f32[16,1,1536]{2,1,0} fusion(%p0, %p1), kind=kCustom, calls=%c1
  %input_reduce_fusion.29 = bf16[576]{0} fusion(%p0, %p2), kind=kInput, calls=%c2, metadata={op_name="jit(loop)/while/body/...i,oi->...o/dot_general"}
  %input_reduce_fusion.11 = f32[] fusion(%p3), kind=kInput, calls=%c3, metadata={op_name="jit(loop)/while/body/reduce_sum"}
  %input_reduce_fusion.16 = f32[384]{0} fusion(%p4, %p5), kind=kInput, calls=%c4, metadata={op_name="jit(loop)/while/body/th,eh->te/dot_general"}
  ROOT %loop_add_fusion.7 = bf16[1,1,7168]{2,1,0} fusion(%p6, %p7), kind=kLoop, calls=%c5, metadata={op_name="jit(loop)/while/body/add"}
"""


def _layer(order):
    kernels = {"q_a": ("gemm_fusion_dot_73", 10.0), "kv_a": ("input_reduce_fusion_29", 4.0),
               "norm": ("input_reduce_fusion_11", 1.0), "router": ("input_reduce_fusion_16", 5.0),
               "topk": ("router_topk", 4.0), "mla": ("mla_partial", 7.0)}
    body = [{"kernel": kernels[k][0], "us": kernels[k][1]} for k in order]
    moe = [{"kernel": "anonymous_mosaic_gpu_kernel", "us": 40.0}, {"kernel": "nvjet_sm90_x", "us": 12.0},
           {"kernel": "anonymous_mosaic_gpu_kernel", "us": 20.0}, {"kernel": "loop_add_fusion_7", "us": 2.0}]
    return body + moe


def test_roles_follow_the_hlo_not_the_order(tmp_path):
    order = ["norm", "q_a", "kv_a", "mla", "router", "topk"]
    step = [{"kernel": "gemm_fusion_dot_9", "us": 50.0}] + _layer(order) + _layer(order[::-1]) + _layer(order)
    profile, hlo = tmp_path / "p.json", tmp_path / "p.hlo.txt.gz"
    profile.write_text(json.dumps({"rows": [{"tokens": 1, "sequence": step}]}))
    with gzip.open(hlo, "wt") as f:
        f.write(HLO)
    ops = depth_gap_hlo.hlo_ops(HLO)
    assert ops["input_reduce_fusion_29"]["op"] == "...i,oi->...o" and ops["loop_add_fusion_7"]["op"] == "add"
    layers = [depth_gap_hlo.analyse(s, ops) for s in depth_gap_hlo.layer_segments(step)]
    assert len(layers) == 2  # the layers after the first
    for layer in layers:
        roles = {r["kernel"]: r["role"] for r in layer["rows"]}
        assert roles["gemm_fusion_dot_73"] == "q_a projection" and roles["input_reduce_fusion_29"] == "kv_a projection"
        assert roles["input_reduce_fusion_16"] == "router logits (f32)"
        assert roles["input_reduce_fusion_11"] == "reduce_sum -> f32[]"
        assert [r["role"] for r in layer["rows"] if r["category"] == "routed experts"] == [
            "routed gate + up (moe_wgmma)", "routed down (moe_wgmma)"]
        assert layer["us"] == pytest.approx(31.0 + 74.0)
    assert depth_gap_hlo.main([str(profile), str(hlo)]) == 0


def test_bad_inputs_are_one_line(tmp_path):
    profile, hlo = tmp_path / "p.json", tmp_path / "p.hlo.txt"
    profile.write_text(json.dumps({"rows": [{"tokens": 4, "sequence": []}]}))
    hlo.write_text(HLO)
    with pytest.raises(SystemExit, match="no T = 1 kernel sequence"):
        depth_gap_hlo.main([str(profile), str(hlo)])
    hlo.write_text("HloModule empty")
    with pytest.raises(SystemExit, match="no fusion in it"):
        depth_gap_hlo.main([str(profile), str(hlo)])
