"""Paths named by a checkpoint stay inside its directory.

A checkpoint directory is untrusted input: an index may name `../other.safetensors`, a tokenizer file may
be a symlink to /etc/shadow. Every file the converter reads or copies is resolved (symlinks followed) and
must land inside the resolved checkpoint directory and be a regular file.
"""

from __future__ import annotations

from pathlib import Path

from convert.errors import CheckpointError


def is_within(path: Path, root: Path) -> bool:
    """`path` is `root` or below it (both already resolved)."""
    return path == root or root in path.parents


def file_inside(root: str | Path, name: str | Path, what: str) -> Path:
    """root / name, refused unless it resolves to a regular file inside `root`; `what` says who named it."""
    root = Path(root)
    path = root / name
    try:
        base, real = root.resolve(), path.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise CheckpointError(f"{path}: {what} cannot be resolved ({e})") from None
    if not is_within(real, base):
        raise CheckpointError(f"{path}: {what} resolves to {real}, outside {root}; refusing to read it")
    if not real.exists():
        raise CheckpointError(f"{path}: {what} is missing")
    if not real.is_file():
        raise CheckpointError(f"{path}: {what} is not a regular file")
    return path
