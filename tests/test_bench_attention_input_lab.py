"""bench/labs/attention_input_lab.py: its formulations compute the model's attention input (CPU smoke run)."""

from bench.labs import attention_input_lab as lab


def test_formulations_agree_and_are_timed(tmp_path):
    result = lab.main(["--tiny", "--steps", "2", "--iters", "1", "--out", str(tmp_path)])
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == list(lab.VARIANTS)
    assert rows["plain"]["max_rel_err"] == 0.0
    assert rows["one_weight"]["max_rel_err"] < 1e-2  # the same products, one GEMM
    assert rows["scale_after"]["max_rel_err"] < 2e-2  # the scale rounds to bf16 after the GEMM instead of before
    assert all(r["launches"] > 0 and "device_loop_ms" in r for r in rows.values())
    assert list(tmp_path.glob("attention-input-cpu-*.json"))
