"""bench/labs/tma_stream.py's streams read the tiles they say (their checksums against numpy, under Pallas' GPU interpreter)
and lower to Mosaic GPU at Kimi K2 shapes; bench/labs/tma_stream_lab.py's variants and its CPU run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.labs import tma_stream_lab
from bench.labs.tma_stream import Stream, bytes_read, checksums_reference, stream_checksums, tiles_read
from model.quant import Int4Weight

E, F, H, K = 5, 512, 512, 4


def _int4(key, out, inp):
    kb, ks = jax.random.split(key)
    return Int4Weight(jax.random.bits(kb, (E, out, inp // 8), jnp.uint32),
                      (0.01 + jax.random.uniform(ks, (E, out, inp // 32))).astype(jnp.bfloat16))


@pytest.fixture(scope="module")
def mats():
    kg, ku, kd = jax.random.split(jax.random.PRNGKey(0), 3)
    return dict(gate_up=(_int4(kg, F, H), _int4(ku, F, H)), down=(_int4(kd, H, F),))


@pytest.mark.parametrize("stream", [Stream("gate_up", splits=2, scales=True),
                                    Stream("down", splits=2, k_splits=2, scales=True, rows=128),
                                    Stream("persistent", stages=3, programs=3)])
def test_checksums_are_the_tiles_read(mats, stream):
    ids = jnp.array([3, 1, 4, 0], jnp.int32)
    m = mats["down" if stream.kind == "down" else "gate_up"]
    got_w, got_s = stream_checksums(stream, ids, m, choices=K, interpret=True)
    ref_w, ref_s = checksums_reference(stream, ids, m, choices=K)
    np.testing.assert_array_equal(np.asarray(got_w), ref_w)
    np.testing.assert_allclose(np.asarray(got_s), ref_s, rtol=1e-5)
    # a wrong expert changes the sums: the check can fail
    other_w, _ = checksums_reference(stream, jnp.array([3, 1, 4, 2], jnp.int32), m, choices=K)
    assert not np.array_equal(other_w, ref_w)


def test_persistent_runs_cover_every_step_and_count_the_repeats():
    s = Stream("persistent", programs=3)
    steps = tiles_read(s, K, K, F, H)
    total = K * (F // 64) * (H // 256)
    assert {t[1:] for t in steps} == {(u, rb, k) for u in range(K) for rb in range(F // 64) for k in range(H // 256)}
    assert len(steps) == 3 * -(-total // 3) and bytes_read(s, K, K, F, H) == len(steps) * 2 * 64 * 128


@pytest.mark.parametrize("stream", [Stream("gate_up", splits=7, scales=True), Stream("down", splits=8, k_splits=2),
                                    Stream("persistent", programs=132, stages=8), Stream("contiguous", programs=264)])
def test_lowers_to_mosaic_gpu_at_kimi_shapes(stream):
    sd = jax.ShapeDtypeStruct
    w = lambda o, i: Int4Weight(sd((384, o, i // 8), jnp.uint32), sd((384, o, i // 32), jnp.bfloat16))  # noqa: E731
    m = (w(7168, 2048),) if stream.kind == "down" else (w(2048, 7168), w(2048, 7168))
    lowered = jax.jit(functools.partial(stream_checksums, stream, choices=8)).trace(
        sd((8,), jnp.int32), m).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_bad_streams_and_variants_are_refused():
    with pytest.raises(ValueError, match="rows=100"):
        Stream("down", rows=100)
    with pytest.raises(ValueError, match="kind must be"):
        Stream("sideways")
    for bad in ("g:2", "q:1:1", "xla:3", "c:2:8:s", "p:0:8", "eg:2:7:r128"):
        with pytest.raises(SystemExit):
            tma_stream_lab.parse_args(["--variants", bad])


def test_lab_runs_tiny_on_cpu(tmp_path):
    """The CLI at small dims in the interpreter: every stream's checksums and the persistent kernel against
    moe_wgmma (no timings: --budget-s 0 leaves the rounds out)."""
    result = tma_stream_lab.main(["--tiny", "--out", str(tmp_path), "--budget-s", "0", "--reps", "1",
                                  "--variants", "xla2", "cd:2:3", "pd:3:2:2:1", "layer"])
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["cd:2:3"]["checksums"] == "ok"
    assert rows["pd:3:2:2:1"]["rel_err_vs_engine"] < 1e-5
    assert rows["xla2"]["bytes"] == rows["layer"]["bytes"] == 4 * (3 * 512 * 512 // 2 + 3 * 512 * 512 // 32 * 2)
    assert "error" not in rows["layer"] and rows["layer"]["rel_err_vs_reference"] < 1e-2
    assert (tmp_path / next(p.name for p in tmp_path.iterdir() if p.suffix == ".md")).read_text().count("|") > 10
