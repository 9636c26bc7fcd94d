"""bench.kernel_agreement: the comparison against the plain path, and the CLI's CPU run."""

import json

import numpy as np

from bench.kernel_agreement import compare, main


def test_compare_splits_rows_by_route_causally():
    rng = np.random.default_rng(0)
    b, t, v, layers, k = 2, 3, 50, 2, 4
    ref = rng.normal(size=(b, t, v)).astype(np.float32)
    ref_ids = np.tile(np.arange(k), (layers, b * t, 1))
    ids = ref_ids.copy()
    ids[1, 1, 0] = 9  # sequence 0, token 1, layer 1 picks another expert: tokens 1 and 2 of sequence 0 are affected
    ids[0, 4] = ids[0, 4][::-1]  # the same set in another order is no difference
    out = ref.copy()
    out[0, 1] *= 1.5  # a large change where the route differs
    out[1, 2] += 1e-3 * rng.normal(size=v)  # rounding on a row routed alike
    r = compare(out, ids, ref, ref_ids)
    assert r["choices_differ"] == 1 and r["choices"] == layers * b * t
    assert r["rows_rerouted"] == 2 and r["rows"] == b * t
    assert np.isclose(r["rerouted_max_rel_err"], 0.5, atol=1e-6)
    assert 0 < r["same_route_max_rel_err"] < 1e-2
    assert r["argmax_agree"] == 1.0


def test_cli_on_cpu_agrees_exactly(tmp_path):
    # off the GPU no kernel applies: every variant is the plain path, so the logits agree bit for bit; the paged
    # cache's gathered pages hold the contiguous cache's visible slots
    res = main(["--tiny", "--experts", "int4", "--batches", "2", "--contexts", "32", "--tokens", "2",
                "--variants", "engine", "attention_paged", "--out", str(tmp_path)])
    row, paged = res["rows"]
    assert row["rel_err"] == 0.0 and row["rows"] == 4 and row["choices"] == 3 * 4
    assert paged["variant"] == "attention_paged" and paged["rel_err"] == 0.0 and paged["choices_differ"] == 0
    saved = json.loads(next(tmp_path.glob("kernel-agreement-*.json")).read_text())
    assert saved["rows"][0]["variant"] == "engine"
    assert "| int4 | 2 | 32 | 2 | engine |" in next(tmp_path.glob("kernel-agreement-*.md")).read_text()
