"""Where a conversion writes: DST, its work directory DST.partial and its lock file DST.lock, all beside each
other, and none of them allowed to be, lie inside, or contain the source (`--overwrite` or `--restart` would
otherwise delete it). Light on imports, so that a refused run answers before jax loads."""

from __future__ import annotations

from pathlib import Path

from convert.errors import CheckpointError
from convert.safe_paths import is_within


def partial_dir(dst: str | Path) -> Path:
    dst = Path(dst)
    return dst.with_name(dst.name + ".partial")


def lock_path(dst: str | Path) -> Path:
    dst = Path(dst)
    return dst.with_name(dst.name + ".lock")


def replaced_dir(dst: str | Path) -> Path:
    """Where `--overwrite` moves the old checkpoint while the new one is renamed into place."""
    dst = Path(dst)
    return dst.with_name(dst.name + ".replaced")


def check_destination(src: str | Path, dst: str | Path) -> None:
    """Refuse a DST (or DST.partial / DST.lock / DST.replaced, where `--overwrite` moves the old checkpoint) that is
    SRC, is inside it, or contains it (resolved paths)."""
    source = Path(src).resolve()
    dst = Path(dst).absolute()
    if not dst.name:  # "/": DST.partial and DST.lock are named after DST
        raise CheckpointError(f"{dst}: the destination needs a name of its own (DST.partial and DST.lock go beside it)")
    for path in (dst, partial_dir(dst), lock_path(dst), replaced_dir(dst)):
        real = path.resolve()
        if is_within(real, source):
            raise CheckpointError(f"{path}: is {'SRC' if real == source else 'inside SRC'} ({source}); "
                                  "write the conversion elsewhere")
        if is_within(source, real):
            raise CheckpointError(f"{path}: contains SRC ({source}); write the conversion elsewhere")
