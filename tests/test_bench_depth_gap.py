"""bench.depth_gap: a layer's kernels matched to their roles and bytes, and a trace that is not that layer
refused."""

import json

import pytest

from bench import depth_gap


def _step(us_by_role=lambda i: 1.0 + i):
    layer = [{"kernel": prefix + ("_1" if prefix.endswith("fusion") else ""), "us": us_by_role(i)}
             for i, (prefix, *_rest) in enumerate(depth_gap.LAYER)]
    dense = [{"kernel": "gemm_fusion_dot_9", "us": 50.0}]
    return dense + layer + layer + layer + [{"kernel": "gemm_fusion_dot_72", "us": 500.0}]


def test_layers_after_the_first_routed_experts_are_analysed(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"rows": [{"tokens": 1, "sequence": _step()}]}))
    assert depth_gap.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "mean over its 2 MoE layers" in out
    chunk = depth_gap.layers_of(_step())[0]
    result = depth_gap.analyse(chunk, 4.3)
    assert result["us"] == pytest.approx(sum(1.0 + i for i in range(len(depth_gap.LAYER))))
    # the layer's bytes are the K2.5 layer's at one token: ~500 MB (the step bench's figure for the same layer)
    assert result["MB"] == pytest.approx(500.5, abs=1.0)
    routed = result["categories"]["routed experts"]
    assert routed["kernels"] == 2 and routed["us"] == pytest.approx(29.0 + 31.0)


def test_a_kernel_in_the_wrong_place_is_named(tmp_path):
    step = _step()
    step[1 + 32 + 18]["kernel"] = "loop_add_fusion_3"  # where the second layer's o_proj GEMV should be
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"rows": [{"tokens": 1, "sequence": step}]}))
    with pytest.raises(SystemExit, match="'loop_add_fusion_3' where the layer's 'o_proj'"):
        depth_gap.main([str(path)])


def test_a_profile_without_a_decode_sequence_is_one_line(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"rows": [{"tokens": 4, "sequence": []}]}))
    with pytest.raises(SystemExit, match="no T = 1 kernel sequence"):
        depth_gap.main([str(path)])
