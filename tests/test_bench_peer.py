"""`python -m bench.peer_hf` at tiny dims on CPU: HF transformers' DeepseekV3 on jaxspec's own arrays.

Both sides prefill the same prompt in chunks into their own caches (the way a 32k prompt fits on the GPU); the
first step's logits must then agree, which holds only if the weight mapping, both chunked prefills and both
caches are right."""

import importlib.util

import pytest

from bench.peer_hf import main, prefill_chunk

# find_spec, not importorskip: importing transformers (1.2 s) at collection cost every worker, not only this file's
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def test_peer_after_a_chunked_prefill_agrees_with_jaxspec(tmp_path):
    # 0.0001 GB of scores: chunks of 16 tokens, so the 40-token prompt is prefilled as 16 + 16 + 8
    res = main(["--tiny", "--contexts", "40", "--batches", "2", "--tokens", "1", "2", "--iters", "1",
                "--no-compile", "--prefill-scores-gb", "0.0001", "--out", str(tmp_path)])
    assert not res["errors"], res["errors"]
    assert [(r["batch"], r["context"], r["tokens"]) for r in res["rows"]] == [(2, 40, 1), (2, 40, 2)]
    first = res["rows"][0]
    assert first["logits_rel_err"] < 0.03 and first["argmax_agree"] == 1.0
    assert all(r["hf_eager_ms"] > 0 and r["jaxspec_ms"] > 0 for r in res["rows"])
    assert "| 2 | 40 | 1 |" in next(tmp_path.glob("peer-hf-*.md")).read_text()


def test_prefill_chunk_keeps_scores_under_the_limit():
    assert prefill_chunk(1, 64, 1024, 4.0) == 1024
    chunk = prefill_chunk(8, 64, 32768, 4.0)  # K2.5: 64 heads, batch 8, 32k context
    assert 8 * 64 * chunk * 32768 * 4 <= 4e9 < 8 * 64 * (2 * chunk) * 32768 * 4


def test_peer_refuses_bad_flags():
    with pytest.raises(SystemExit):
        main(["--tiny", "--contexts", "0"])


def test_prefill_in_one_call_or_in_chunks_gives_the_same_first_step(tmp_path):
    from bench.prefill_consistency import main as consistency

    res = consistency(["--tiny", "--batch", "2", "--context", "48", "--chunks", "48", "16", "--out", str(tmp_path)])
    errs = res["rel_err"]
    assert errs["jaxspec chunk 48 vs chunk 16"] < 1e-3 and errs["hf chunk 48 vs chunk 16"] < 1e-3
    assert errs["jaxspec vs hf, chunk 48"] < 0.03 and errs["jaxspec vs hf, chunk 16"] < 0.03
