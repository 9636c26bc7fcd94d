"""Lazy reader of safetensors checkpoints (single file or sharded with model.safetensors.index.json).

Reads one tensor at a time straight from the file, into numpy with ml_dtypes for bf16 / fp8: the
safetensors package's numpy backend cannot represent bf16 and its flax backend cannot represent fp8.
Every structural problem (missing shard, truncated file, bad header) raises CheckpointError naming the
file and tensor.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config; names the file and tensor."""


DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


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
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        self.entries: dict[str, dict] = header
        for name, e in header.items():
            if e.get("dtype") not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {e.get('dtype')!r}")
            begin, end = e["data_offsets"]
            expected = int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(DTYPES[e["dtype"]]).itemsize
            if end - begin != expected:
                raise CheckpointError(f"{self.path}: tensor '{name}' has {end - begin} bytes, shape needs {expected}")
            if self.data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: truncated safetensors file: tensor '{name}' ends at byte "
                    f"{self.data_start + end}, file has {size}"
                )

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


class CheckpointReader:
    """All tensors of a HF checkpoint directory, by name, read lazily."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        self.index_path: Path | None = index if index.exists() else None
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: invalid index ({e})") from None
            for fname in sorted(set(weight_map.values())):
                if not (self.directory / fname).exists():
                    first = next(n for n, f in weight_map.items() if f == fname)
                    raise CheckpointError(f"{self.directory / fname}: shard named in {index.name} is missing (holds '{first}')")
                self.files[fname] = SafetensorsFile(self.directory / fname)
            for name, fname in weight_map.items():
                if name not in self.files[fname].entries:
                    raise CheckpointError(f"{self.directory / fname}: tensor '{name}' named in {index.name} is not in the file")
                self.where[name] = fname
        else:
            shards = sorted(self.directory.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.directory}: no *.safetensors files")
            for p in shards:
                self.files[p.name] = SafetensorsFile(p)
                for name in self.files[p.name].keys():
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
