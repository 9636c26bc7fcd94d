"""Lazy reader of safetensors checkpoints (single file or sharded with model.safetensors.index.json).

Reads one tensor at a time straight from the file, into numpy with ml_dtypes for bf16 / fp8: the
safetensors package's numpy backend cannot represent bf16 and its flax backend cannot represent fp8.

A checkpoint is untrusted input, so every header is checked strictly before a byte of data is read: a
JSON object of {name: {dtype, shape, data_offsets}} (no duplicate keys), known dtypes, offsets that are
non-negative, ordered, contiguous from the data start to the end of the file with nothing overlapping,
`end - begin == numel * itemsize`, and a sane header length; the safetensors package then opens the file
as a second, independent opinion. Every file named by an index stays inside the checkpoint directory.
Every problem raises CheckpointError naming the file and tensor.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from convert.errors import CheckpointError
from convert.json_input import parse_json
from convert.safe_paths import file_inside

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
# the safetensors format's own limit on the JSON header
MAX_HEADER_BYTES = 100 * 2**20
ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
INDEX_NAME = "model.safetensors.index.json"


def _no_duplicate_keys(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(path: Path, raw: bytes, data_bytes: int) -> tuple[dict, dict]:
    """The JSON header of a safetensors file -> ({name: entry}, metadata); refuses anything off-spec."""
    try:
        header = parse_json(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is a JSON {type(header).__name__}, not an object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: safetensors __metadata__ must map strings to strings")
    spans = []
    for name, e in header.items():
        where = f"{path}: tensor '{name}'"
        if not isinstance(e, dict) or set(e) != ENTRY_KEYS:
            got = sorted(e) if isinstance(e, dict) else type(e).__name__
            raise CheckpointError(f"{where}: header entry must be an object with keys {sorted(ENTRY_KEYS)}, got {got}")
        if e["dtype"] not in DTYPES:
            raise CheckpointError(f"{where} has unsupported dtype {e['dtype']!r}")
        shape, offsets = e["shape"], e["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{where} has an invalid shape {shape!r} (a list of non-negative integers)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where} has invalid data_offsets {offsets!r} (two non-negative integers, begin <= end)")
        begin, end = offsets
        expected = math.prod(shape) * np.dtype(DTYPES[e["dtype"]]).itemsize
        if end - begin != expected:
            raise CheckpointError(f"{where} has {end - begin} bytes, shape {shape} of {e['dtype']} needs {expected}")
        spans.append((begin, end, name))
    spans.sort()
    at = 0
    for begin, end, name in spans:
        if end > data_bytes:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor '{name}' ends at data byte {end}, the file holds {data_bytes}"
            )
        if begin < at:
            raise CheckpointError(f"{path}: tensor '{name}' overlaps the tensor before it (data_offsets begin {begin} < {at})")
        if begin > at:
            raise CheckpointError(f"{path}: tensor '{name}' leaves a gap of {begin - at} bytes before it (data_offsets begin {begin})")
        at = end
    if at != data_bytes:
        raise CheckpointError(f"{path}: {data_bytes - at} bytes after the last tensor are not described by the header")
    return header, metadata


def _second_opinion(path: Path) -> None:
    """The safetensors package's own header validation (it does not need to read a tensor for it)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy"):
            pass
    except SafetensorError as e:
        raise CheckpointError(f"{path}: the safetensors library rejects this file ({e})") from None


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", raw)
                if n > size - 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file (header of {n} bytes)")
                if n < 2 or n > MAX_HEADER_BYTES:
                    raise CheckpointError(f"{self.path}: not a safetensors file (header length {n})")
                header_bytes = f.read(n)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.path}: is a directory, not a safetensors file") from None
        self.data_start = 8 + n
        self.size = size
        self.entries, self.metadata = parse_header(self.path, header_bytes, size - self.data_start)
        _second_opinion(self.path)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(DTYPES[self.entries[name]["dtype"]])

    def nbytes(self, name: str) -> int:
        begin, end = self.entries[name]["data_offsets"]
        return end - begin

    def get(self, name: str) -> np.ndarray:
        e = self.entries[name]
        begin, end = e["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            buf = f.read(end - begin)
        if len(buf) != end - begin:
            raise CheckpointError(f"{self.path}: truncated while reading tensor '{name}'")
        return np.frombuffer(buf, dtype=self.dtype(name)).reshape(e["shape"])


def read_weight_map(index: Path) -> dict[str, str]:
    try:
        doc = parse_json(index.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: invalid index ({e})") from None
    except IsADirectoryError:
        raise CheckpointError(f"{index}: is a directory, not an index file") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: invalid index ('weight_map' must be an object of tensor name -> file name)")
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname:
            raise CheckpointError(f"{index}: invalid index: tensor '{name}' maps to {fname!r}, not a file name")
    return weight_map


class CheckpointReader:
    """All tensors of a HF checkpoint directory, by name, read lazily."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        self.index_path: Path | None = None
        if index.exists() or index.is_symlink():
            self.index_path = file_inside(self.directory, INDEX_NAME, "the index")
            weight_map = read_weight_map(index)
            for fname in sorted(set(weight_map.values())):
                first = next(n for n, f in weight_map.items() if f == fname)
                path = self.directory / fname
                if not path.exists() and not path.is_symlink():
                    raise CheckpointError(f"{path}: shard named in {index.name} is missing (holds '{first}')")
                file_inside(self.directory, fname, f"shard named in {index.name} (holds '{first}')")
                self.files[fname] = SafetensorsFile(path)
            for name, fname in weight_map.items():
                if name not in self.files[fname].entries:
                    raise CheckpointError(f"{self.directory / fname}: tensor '{name}' named in {index.name} is not in the file")
                self.where[name] = fname
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.directory}: no *.safetensors files")
            for p in shards:
                file_inside(self.directory, p.name, "safetensors file")
                self.files[p.name] = SafetensorsFile(p)
                for name in self.files[p.name].keys():
                    if name in self.where:
                        raise CheckpointError(f"{p}: tensor '{name}' is also in {self.directory / self.where[name]}")
                    self.where[name] = p.name

    def names(self) -> list[str]:
        return list(self.where)

    def has(self, name: str) -> bool:
        return name in self.where

    def file_of(self, name: str) -> Path:
        return self.directory / self.where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[self._need(name)]].shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self.files[self.where[self._need(name)]].dtype(name)

    def nbytes(self, name: str) -> int:
        return self.files[self.where[self._need(name)]].nbytes(name)

    def get(self, name: str) -> np.ndarray:
        return self.files[self.where[self._need(name)]].get(name)

    def _need(self, name: str) -> str:
        if name not in self.where:
            raise CheckpointError(f"{self.directory}: missing tensor '{name}'")
        return name


__all__ = ["CheckpointError", "CheckpointReader", "DTYPES", "SafetensorsFile", "parse_header"]
