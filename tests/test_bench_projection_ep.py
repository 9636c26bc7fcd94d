"""bench.projection_ep: the 8-device paper projection's arithmetic (no device needed)."""

import json

import pytest

from bench import depth_gap, projection_ep
from tests.test_bench_depth_gap import _step
from tests.test_bench_projection import CYCLES, DEPTH

# launch-bound small kernels of 2-4 us, every kernel that reads weights 20 us
PROFILE = {"rows": [{"tokens": 1, "sequence": _step(
    lambda i: 2.0 + i % 3 if depth_gap.LAYER[i][2] == depth_gap.SMALL else 20.0)}]}
EP = {"rows": [{"local_slots": 1, "skip": {"ms": 0.030}}, {"local_slots": 7, "skip": {"ms": 0.078}}]}
ALL_REDUCE = {"rows": [{"tokens": 1, "all_reduces_per_moe_layer": 2, "all_reduce_us": 150.0}]}


def test_the_busiest_device_follows_the_routing():
    one = projection_ep.busiest_device_slots(1, "independent", draws=400)
    assert 1.0 < one < 8.0  # 8 choices over 8 devices: some device holds two or more
    # every token choosing the same experts puts T times one token's slots on each device (other draws: in
    # distribution)
    assert projection_ep.busiest_device_slots(4, "shared", draws=400) / 4 == pytest.approx(
        projection_ep.busiest_device_slots(1, "shared", draws=400), rel=0.1)
    assert projection_ep.busiest_device_slots(4, "shared", draws=400) > projection_ep.busiest_device_slots(
        4, "independent", draws=400)


def test_a_layer_is_its_replicated_sharded_and_routed_kernels_plus_its_all_reduces(tmp_path):
    files = {}
    for name, data in (("profile", PROFILE), ("depth", DEPTH), ("ep", EP), ("ar", ALL_REDUCE), ("cycles", CYCLES)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(data))
    r = projection_ep.main(["--profile", str(files["profile"]), "--depth", str(files["depth"]), "--ep-slots",
                            str(files["ep"]), "--all-reduce", str(files["ar"]), "--cycles", str(files["cycles"]),
                            "--routing", "shared", "--all-reduce-us", "0", "10", "--out", str(tmp_path / "out")])
    base, per_slot = projection_ep.slot_price(EP)
    assert (base, per_slot) == pytest.approx((22.0, 8.0))
    layer = r["layer"]
    zero, ten = r["tables"]
    d0 = zero["decode"]
    assert d0["routed_us"] == pytest.approx(base + per_slot * d0["busiest_device_slots"])
    assert d0["layer_us"] == pytest.approx(layer["replicated_us"] + layer["sharded_us"] + d0["routed_us"])
    assert ten["decode"]["layer_us"] == pytest.approx(d0["layer_us"] + 2 * 10.0)
    assert d0["ms"] == pytest.approx(r["fixed_ms"] + 60 * d0["layer_us"] / 1e3)
    # the sharded kernels run over an eighth of their weights, none below the launch-bound kernels' median
    assert layer["sharded_us"] < layer["sharded_one_device_us"]
    assert layer["sharded_us"] >= len(projection_ep.SHARDED_ROLES) * r["min_kernel_us"]
    for c in zero["cycles"]:
        assert c["break_even_length"] == pytest.approx(c["cycle_ms"] / d0["ms"])
    assert list((tmp_path / "out").glob("projection-ep-*.md"))


def test_ep_slots_need_two_slot_counts():
    with pytest.raises(SystemExit, match="two different counts"):
        projection_ep.slot_price({"rows": [{"local_slots": 1, "skip": {"ms": 0.03}}]})
