"""bench/labs/router_dtype_lab.py: a bf16 router and its float32 widening choose the same experts (CPU smoke run)."""

from bench.labs import router_dtype_lab as lab


def test_both_dtypes_route_alike_and_are_timed(tmp_path):
    result = lab.main(["--tiny", "--tokens", "1", "3", "--steps", "2", "--iters", "1", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["tokens"], r["router_dtype"]) for r in rows] == [(1, "bfloat16"), (1, "float32"), (3, "bfloat16"),
                                                                (3, "float32")]
    assert all(r["same_ids"] and r["max_weight_diff"] < 1e-6 and "device_loop_ms" in r for r in rows)
    assert rows[0]["floor_us"] < rows[1]["floor_us"]  # half the weight's bytes
    assert list(tmp_path.glob("router-dtype-cpu-*.json"))
