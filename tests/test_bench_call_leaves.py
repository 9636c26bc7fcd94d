"""bench.labs.call_leaves: calls that take N argument arrays, separate or packed, timed on any device."""

import json

import jax.numpy as jnp

from bench.labs.call_leaves import main, programs


def test_the_programs_keep_their_arguments_and_compute_the_same():
    progs, state = programs(5, 4)
    for name, (compiled, w) in progs.items():
        out = compiled(w, jnp.copy(state))
        assert float(out.sum()) == (4.0 if name != "separate_empty_loop" else 0.0), name  # the loop runs no trip
        # the arrays are the program's parameters, not pruned: 5 and the state, or the packed one and the state
        assert f"parameter({1 if name == 'packed' else 5})" in compiled.as_text(), name


def test_the_command_line_writes_a_slope(tmp_path):
    main(["--leaves", "0", "20", "--calls", "3", "--width", "4", "--out", str(tmp_path)])
    result = json.loads(next(tmp_path.glob("call-leaves-*.json")).read_text())
    assert [r["leaves"] for r in result["rows"]] == [0, 20] and result["slope_us_per_array"] is not None
    assert (tmp_path / next(tmp_path.glob("call-leaves-*.md")).name).read_text().startswith("# A call's price")
