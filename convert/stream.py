"""Streaming, resumable conversion of a HF checkpoint directory into a jaxspec checkpoint.

Targets go item by item (embeddings, each decoder layer, head): read the item's tensors one at a time,
stack and (de)quantize on the host, save it as its own orbax item, drop it. Peak host memory is about
one item (a layer's experts), never the model. Items already saved by an interrupted run are skipped.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from convert.checkpoint import CheckpointWriter, dtype_name
from convert.hf_draft_weights import build_draft, plan_draft
from convert.hf_weights import WeightBuilder
from convert.progress import CountingSource, progress_bar
from convert.safetensors_reader import CheckpointError, CheckpointReader
from convert.tensor_plan import check_item_consumed, plan_target
from model.config import ConfigError, text_config_from_dict
from model.eagle3 import draft_config_from_dict

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "float16": "float16"}
# test hook: SIGKILL ourselves after this many items are saved, as a crash or `kill -9` would
KILL_AFTER_ITEMS_ENV = "JAXSPEC_CONVERT_KILL_AFTER_ITEMS"


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    dtype: str = "bfloat16"  # dense float weights (and dequantized ones) are stored in this dtype
    experts: str = "keep"  # "keep": INT4 / FP8 experts stay quantized; "bf16": dequantize them to `dtype`
    restart: bool = False  # discard an unfinished DST.partial instead of resuming it
    overwrite: bool = False  # replace an existing DST
    progress: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose one of {sorted(set(DTYPES))}")
        if self.experts not in ("keep", "bf16", "dense"):
            raise ConfigError(f"--experts {self.experts!r}: choose 'keep' or 'bf16'")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_config(src: Path) -> dict:
    path = src / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def checkpoint_kind(raw: dict) -> str:
    archs = raw.get("architectures") or []
    return "draft" if any("Eagle3" in a for a in archs) else "target"


def source_fingerprint(src: Path, reader: CheckpointReader) -> dict:
    """What a resumed run must find unchanged: the source path and the size of every shard."""
    return {"path": str(src.resolve()), "files": {n: os.path.getsize(src / n) for n in sorted(reader.files)}}


def release_host_memory() -> None:
    """Give the freed item back to the OS: glibc keeps freed heap pages, and over 61 layers the
    fragments would add up to more than the one layer the streaming promises. (The item's arrays are
    already freed by reference counting; a gc pass would cost seconds in a process holding torch.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _kill_hook(saved_this_run: int) -> None:
    limit = os.environ.get(KILL_AFTER_ITEMS_ENV)
    if limit is not None and saved_this_run >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)


def convert_checkpoint(src: str | Path, dst: str | Path, opts: ConvertOptions = ConvertOptions(),
                       log: Callable[[str], None] = _log) -> Path:
    src, dst = Path(src), Path(dst)
    raw = read_config(src)
    if checkpoint_kind(raw) == "draft":
        return convert_draft(src, dst, raw, opts, log)
    return convert_target(src, dst, raw, opts, log)


def convert_target(src: Path, dst: Path, raw: dict, opts: ConvertOptions, log) -> Path:
    cfg = text_config_from_dict(raw, where=str(src / "config.json"))
    dtype = DTYPES[opts.dtype]
    reader = CheckpointReader(src)
    text = raw.get("text_config", raw)
    plan = plan_target(reader, cfg, int(text.get("num_nextn_predict_layers", 0) or 0))
    if plan.skipped_vision:
        log(f"convert: skipping {len(plan.skipped_vision)} vision tensors (vision_tower.*, mm_projector.*): "
            "jaxspec serves the text model only")
    if plan.skipped_mtp:
        log(f"convert: skipping {len(plan.skipped_mtp)} multi-token-prediction tensors "
            f"(model.layers.{cfg.num_hidden_layers}.*): jaxspec does not use the MTP layer")
    dequantize = opts.experts != "keep" or plan.expert_storage == "dense"
    experts = dtype if dequantize else plan.expert_storage
    if plan.expert_storage == "none":
        experts = "none"
    options = {"kind": "target", "dtype": dtype, "experts": experts, "source": source_fingerprint(src, reader)}
    writer = CheckpointWriter(dst, options, restart=opts.restart, overwrite=opts.overwrite)
    done = [item for item in plan.items if writer.is_done(item)]
    if done:
        log(f"convert: resuming {writer.work}: {len(done)} of {len(plan.items)} items already converted")
    bar = progress_bar(plan.total_bytes, sum(plan.item_bytes[i] for i in done), opts.progress)
    builder = WeightBuilder(CountingSource(reader, bar.update), cfg, np.dtype(dtype), dequantize_experts=dequantize)
    saved = 0
    for item, names in plan.items.items():
        if item in done:
            continue
        builder.used = set()
        tree = builder.item(item)
        check_item_consumed(item, names, builder.used)
        writer.save_item(item, tree)
        del tree
        release_host_memory()
        saved += 1
        _kill_hook(saved)
    bar.close()
    meta = {
        "kind": "target", "dtype": dtype, "experts": experts, "items": list(plan.items),
        "source": {"path": str(src.resolve()), "quantization": None if cfg.quant is None else cfg.quant.method,
                   "tensors": len(reader.names()), "bytes": plan.total_bytes},
        "skipped": {"vision": len(plan.skipped_vision), "mtp": len(plan.skipped_mtp)},
    }
    out = writer.finish(src / "config.json", meta, src)
    log(f"convert: wrote {out} ({len(plan.items)} items, experts {experts}, dtype {dtype})")
    return out


def convert_draft(src: Path, dst: Path, raw: dict, opts: ConvertOptions, log) -> Path:
    where = str(src / "config.json")
    cfg = draft_config_from_dict(raw, where)
    q = raw.get("quantization_config")
    if q:
        raise ConfigError(f"{where}: unsupported quantization_config.quant_method={q.get('quant_method')!r} for an "
                          "EAGLE-3 drafter (drafters are converted from bf16 / f32 weights)")
    dtype = DTYPES[opts.dtype]
    reader = CheckpointReader(src)
    names = plan_draft(reader, cfg, raw)
    options = {"kind": "draft", "dtype": dtype, "source": source_fingerprint(src, reader)}
    writer = CheckpointWriter(dst, options, restart=opts.restart, overwrite=opts.overwrite)
    total = sum(reader.nbytes(n) for n in names)
    if not writer.is_done("draft"):
        bar = progress_bar(total, 0, opts.progress)
        writer.save_item("draft", build_draft(CountingSource(reader, bar.update), cfg, names, np.dtype(dtype)))
        bar.close()
    meta = {"kind": "draft", "dtype": dtype, "experts": None, "items": ["draft"],
            "source": {"path": str(src.resolve()), "tensors": len(names), "bytes": total}}
    out = writer.finish(src / "config.json", meta, src)
    log(f"convert: wrote {out} (EAGLE-3 drafter, dtype {dtype})")
    return out


__all__ = ["CheckpointError", "ConfigError", "ConvertOptions", "convert_checkpoint"]
