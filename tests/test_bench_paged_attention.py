"""bench.paged_attention on CPU at tiny dims: a step over a paged cache read through the block table (the dispatch
answering as on a GPU, the kernels in interpret mode) is timed beside the reference and agrees with it."""

import functools
import json

from bench.paged_attention import main


def test_cli_on_cpu_reads_pages_in_the_kernel_and_agrees(tmp_path, monkeypatch):
    import model.attention_mla as attention_mla
    from model.kernels import dispatch

    monkeypatch.setattr(attention_mla, "mla_kernel_applies",
                        functools.partial(dispatch.mla_kernel_applies, backend="gpu"))
    res = main(["--tiny", "--batches", "2", "--contexts", "64", "--tokens", "4", "--layers", "2", "--warmup", "1",
                "--iters", "2", "--layouts", "paged_kernel", "--out", str(tmp_path)])
    reference, paged = res["rows"]
    assert (reference["layout"], paged["layout"]) == ("contiguous_xla", "paged_kernel")
    assert paged["kernel_reads_pages"] and paged["capacity"] == 128 and paged["pages_held"] == 2
    assert 0 < paged["rel_err"] < 2e-2  # bf16 kernels against XLA's bf16 attention
    assert paged["median_ms"] > 0 and paged["min_ms"] <= paged["median_ms"] <= paged["max_ms"]
    assert paged["layer_ms"] == paged["median_ms"] / 2
    saved = json.loads(next(tmp_path.glob("paged-attention-*.json")).read_text())
    assert [r["layout"] for r in saved["rows"]] == ["contiguous_xla", "paged_kernel"] and not saved["skipped"]
    assert "| 2 | 64 | 4 | paged_kernel |" in next(tmp_path.glob("paged-attention-*.md")).read_text()
