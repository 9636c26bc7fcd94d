"""Progress display: a tqdm bar with the latest metrics on a terminal, plain periodic lines in a log."""

from __future__ import annotations

import sys
import time


def format_metrics(metrics: dict) -> str:
    parts = []
    for k, v in metrics.items():
        if isinstance(v, (list, tuple)):
            parts.append(f"{k}=[" + " ".join(f"{x:.3f}" for x in v) + "]")
        elif isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


class Progress:
    def __init__(self, name: str, every: int = 50, interactive: bool | None = None):
        self.name, self.every = name, every
        self.t0 = time.perf_counter()
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar = None
        if self.interactive:
            try:
                from tqdm import tqdm

                self.bar = tqdm(desc=name, unit="step", dynamic_ncols=True)
            except ImportError:
                self.interactive = False

    def update(self, step: int, total: int | None, metrics: dict) -> None:
        if self.bar is not None:
            if total is not None and self.bar.total != total:
                self.bar.total = total
            self.bar.n = step
            self.bar.set_postfix_str(format_metrics(metrics), refresh=True)
        else:
            self.log(f"step {step}/{total if total is not None else '?'} {format_metrics(metrics)}")

    def log(self, message: str) -> None:
        line = f"[{self.name} {time.perf_counter() - self.t0:7.1f}s] {message}"
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
