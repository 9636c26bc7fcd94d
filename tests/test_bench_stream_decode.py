"""bench.labs.stream_decode times the streamed decode against the whole-list one; both must give the whole text."""

from bench.labs import stream_decode


def test_times_both_decoders_on_the_same_text():
    rows = stream_decode.main(["--tokens", "40", "--per-push", "1", "3", "--repeats", "1"])
    assert [(r["tokens"], r["per_push"]) for r in rows] == [(40, 1), (40, 3)]
    assert all(r["stream_decoder_ms"] > 0 and r["whole_list_ms"] > 0 for r in rows)
