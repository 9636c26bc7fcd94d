"""The default corpus: the running Python's standard-library sources, split by a hash of each path.

Any user can rebuild it offline, and the held-out split is stable across machines and Python versions
because it depends only on the relative path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class SourceFile:
    rel_path: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def path_fraction(rel_path: str) -> float:
    """The first 4 bytes of sha1(path) as a fraction in [0, 1): the file's place in every split."""
    return int.from_bytes(hashlib.sha1(rel_path.encode()).digest()[:4], "big") / 2**32


def is_held_out(rel_path: str, held_out_percent: float) -> bool:
    return path_fraction(rel_path) * 100.0 < held_out_percent


def read_sources(root: Path | str | None = None, max_files: int | None = None) -> list[SourceFile]:
    """Every UTF-8 *.py file under `root` (default: this Python's stdlib; installed packages excluded), by path."""
    root = stdlib_root() if root is None else Path(root)
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):  # a few test files are deliberately mis-encoded
            continue
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
        if max_files is not None and len(files) >= max_files:
            break
    return files


def split_sources(files: list[SourceFile], held_out_percent: float, val_percent: float = 0.0):
    """-> (train, held_out, validation): held-out below `held_out_percent`, validation the next `val_percent`."""
    held, val, train = [], [], []
    for f in files:
        u = path_fraction(f.rel_path) * 100.0
        (held if u < held_out_percent else val if u < held_out_percent + val_percent else train).append(f)
    return train, held, val
