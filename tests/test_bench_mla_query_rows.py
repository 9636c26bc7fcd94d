"""bench.labs.mla_query_rows on the CPU (interpret mode): its reference and the kernels agree, masked or whole."""

from bench.labs import mla_query_rows as lab


def test_every_row_agrees_in_the_interpreter():
    rows = lab.main(["--interpret", "--context", "40"])
    assert [(r["heads"], r["tokens"]) for r in rows] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    assert all(r["max_rel_err"] < 2e-2 for r in rows)  # bf16 inputs and context, float32 reference
