"""`python -m bench.labs.graph_launch_lab`: programs of N links, their kernels counted from a real profiler trace and
the per-kernel cost fitted over N (on CPU the XLA programs only; the Pallas kinds need the GPU)."""

import pytest

from bench.labs.graph_launch_lab import main, make_program


def test_programs_of_more_links_launch_more_kernels(tmp_path):
    result = main(["--links", "2", "8", "--kinds", "xla", "mosaic", "--iters", "3", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [r["kind"] for r in rows] == ["xla", "xla"]  # no Mosaic GPU on a CPU: left out, not faked
    assert rows[1]["kernels"] > rows[0]["kernels"] > 0
    for r in rows:
        assert r["sync_ms"] > 0 and r["queued_ms"] > 0
        assert abs(r["host_ms"] - (r["sync_ms"] - r["queued_ms"])) < 1e-12
    assert set(result["slopes"]["xla"]) == {"sync_us_per_kernel", "queued_us_per_kernel"}
    assert next(tmp_path.glob("graph-launch-lab-*.json")).stat().st_size > 0


def test_program_computes_the_chain():
    import jax.numpy as jnp
    import numpy as np

    from bench.labs.graph_launch_lab import SHAPE

    x = jnp.full(SHAPE, 2.0, jnp.float32)
    expect = np.full(SHAPE, 2.0)
    for _ in range(3):
        expect = expect * 0.5 + 1e-3 * expect.sum()
    np.testing.assert_allclose(np.asarray(make_program(3, "xla", 1)(x)), expect, rtol=1e-5)
    with pytest.raises(SystemExit, match="--every"):
        main(["--every", "0", "--kinds", "xla"])
