"""Digests of a converted checkpoint's files: recorded when they are written, verified when they are read.

The manifest (in jaxspec_checkpoint.json) maps every file of the checkpoint but the metadata file and the
completion marker to its size and SHA-256. Loading compares sizes and presence by default (a stat per
file) and every digest on request; `python -m convert --check` verifies every digest. Each orbax item's
files are hashed right after the item is saved, while they are still in the page cache.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from convert.errors import CheckpointError

CHUNK = 8 * 2**20
DIGEST = "sha256"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe_files(root: Path, paths) -> dict[str, dict]:
    """{path relative to root: {"bytes", "sha256"}} of the given files."""
    out = {}
    for p in sorted(paths):
        out[p.relative_to(root).as_posix()] = {"bytes": p.stat().st_size, DIGEST: file_digest(p)}
    return out


def describe_tree(root: Path, directory: Path) -> dict[str, dict]:
    """Every regular file under `directory` (symlinks are never written by the converter: refuse them)."""
    files = []
    for p in directory.rglob("*"):
        if p.is_symlink():
            raise CheckpointError(f"{p}: unexpected symlink in a checkpoint being written")
        if p.is_file():
            files.append(p)
    return describe_files(root, files)


def verify_manifest(root: Path, manifest: dict, full: bool, only=None) -> list[str]:
    """Problems found (empty: all good). Sizes and presence always; digests when `full`.
    `only(name) -> bool` restricts the check to some files."""
    problems = []
    if not isinstance(manifest, dict):
        return [f"{root}: the manifest is not an object"]
    for name, want in sorted(manifest.items()):
        if only is not None and not only(name):
            continue
        path = root / name
        if not isinstance(want, dict) or not isinstance(want.get("bytes"), int) or not isinstance(want.get(DIGEST), str):
            problems.append(f"{path}: malformed manifest entry")
            continue
        if ".." in Path(name).parts or Path(name).is_absolute():
            problems.append(f"{path}: manifest entry leaves the checkpoint")
            continue
        if path.is_symlink() or not path.is_file():
            problems.append(f"{path}: missing (listed in the manifest)")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path}: {size} bytes, the manifest says {want['bytes']}")
            continue
        if full and file_digest(path) != want[DIGEST]:
            problems.append(f"{path}: SHA-256 differs from the manifest (the file was modified or corrupted)")
    return problems
