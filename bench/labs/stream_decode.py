"""`python -m bench.labs.stream_decode`: host time to stream an answer's text, `jaxspec.tokenizer.StreamDecoder`
(each push decodes the new tokens with the last emitted piece's) against decoding the whole token list at every
push (what it did before), on the embedded model's tokenizer, for answers of N tokens pushed K at a time (a device
step's tokens). Median of --repeats runs each, after one warm-up; both must give the whole decode's text.

    python -m bench.labs.stream_decode --tokens 2000 8000 16000 --per-push 1 4
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

from jaxspec.cli_common import DEFAULT_MODEL_DIR
from jaxspec.tokenizer import StreamDecoder, load_tokenizer


class WholeListDecoder:
    """The reference: the whole list decoded at every push, the stable part past what was emitted returned."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.emitted = tokenizer, [], 0

    def push(self, new_ids):
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        stable = len(text.rstrip("\ufffd"))
        out = text[self.emitted:stable] if stable > self.emitted else ""
        self.emitted = max(self.emitted, stable)
        return out

    def flush(self):
        text = self.tokenizer.decode(self.ids)
        out, self.emitted = text[self.emitted:], len(text)
        return out


def stream_s(make, ids, per_push: int) -> tuple[float, str]:
    dec = make()
    t0 = time.perf_counter()
    pieces = [dec.push(ids[i:i + per_push]) for i in range(0, len(ids), per_push)] + [dec.flush()]
    return time.perf_counter() - t0, "".join(pieces)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.labs.stream_decode", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000, 16000])
    p.add_argument("--per-push", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if min(a.tokens) < 1 or min(a.per_push) < 1 or a.repeats < 1:
        p.error("--tokens, --per-push and --repeats must be >= 1")
    tok = load_tokenizer(DEFAULT_MODEL_DIR / "target")
    source = inspect.getsource(inspect) + inspect.getsource(argparse)
    corpus = tok.encode(source)
    while len(corpus) < max(a.tokens):
        corpus += corpus
    rows = []
    for n in a.tokens:
        ids = corpus[:n]
        want = tok.decode(ids)
        for k in a.per_push:
            row = dict(tokens=n, per_push=k)
            for name, make in (("stream_decoder", lambda: StreamDecoder(tok)),
                               ("whole_list", lambda: WholeListDecoder(tok))):
                stream_s(make, ids, k)  # warm-up
                runs = [stream_s(make, ids, k) for _ in range(a.repeats)]
                assert all(text == want for _, text in runs), name
                times = [t for t, _ in runs]
                row[f"{name}_ms"] = 1e3 * statistics.median(times)
                row[f"{name}_range_ms"] = [1e3 * min(times), 1e3 * max(times)]
            rows.append(row)
            print(f"{n:6d} tokens, {k} a push: StreamDecoder {row['stream_decoder_ms']:9.2f} ms "
                  f"({row['stream_decoder_range_ms'][0]:.2f}-{row['stream_decoder_range_ms'][1]:.2f}), whole list "
                  f"{row['whole_list_ms']:9.2f} ms ({row['whole_list_range_ms'][0]:.2f}-"
                  f"{row['whole_list_range_ms'][1]:.2f}); median of {a.repeats}", flush=True)
    return rows


if __name__ == "__main__":
    main()
