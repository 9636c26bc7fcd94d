"""Streaming, resumable conversion of a HF checkpoint directory into a jaxspec checkpoint.

Targets go item by item (embeddings, each decoder layer, head): read the item's tensors one at a time,
stack and (de)quantize on the host, save it as its own orbax item, drop it. Peak host memory is about
one item (a layer's experts), never the model. Items already saved by an interrupted run are skipped.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import struct
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from convert.checkpoint import CheckpointWriter
from convert.destination import check_destination
from convert.dst_lock import DestinationLock
from convert.errors import CheckpointError
from convert.finite import refuse_nonfinite
from convert.json_input import parse_json
from convert.observed_source import ObservedSource
from convert.hf_draft_weights import build_draft, plan_draft
from convert.hf_weights import WeightBuilder
from convert.progress import count_bytes, progress_bar
from convert.safe_paths import file_inside
from convert.safetensors_reader import CheckpointReader
from convert.tokenizer_files import tokenizer_files
from convert.tensor_plan import check_item_consumed, plan_target
from model.config import ConfigError, text_config_from_dict
from model.eagle3 import draft_config_from_dict

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "float16": "float16"}
# config.json model_type values of the architectures jaxspec converts (K2.5 wraps a kimi_k2 text_config); MLA
# drafters carry their target's (TorchSpec writes kimi_k2, DeepseekV3Config deepseek_v3)
TARGET_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")
DRAFT_MODEL_TYPES = ("llama", "deepseek_v2", "deepseek_v3", "kimi_k2")


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    dtype: str = "bfloat16"  # dense float weights (and dequantized ones) are stored in this dtype
    experts: str = "keep"  # "keep": INT4 / FP8 experts stay quantized; "bf16": dequantize them to `dtype`
    restart: bool = False  # discard an unfinished DST.partial instead of resuming it
    overwrite: bool = False  # replace an existing DST (only a jaxspec checkpoint)
    progress: bool = True
    allow_nonfinite: bool = False  # convert weights holding NaN / Inf instead of refusing them

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: choose one of {sorted(set(DTYPES))}")
        if self.experts not in ("keep", "bf16", "dense"):
            raise ConfigError(f"--experts {self.experts!r}: choose 'keep' or 'bf16'")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_config(src: Path) -> dict:
    if not src.is_dir():
        raise ConfigError(f"{src}: {'not a directory' if src.exists() else 'no such directory'} "
                          "(SRC is a HF checkpoint directory holding config.json)")
    path = file_inside(src, "config.json", "config file")
    try:
        raw = parse_json(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a JSON object, not a {type(raw).__name__}")
    return raw


def checkpoint_kind(raw: dict) -> str:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"config.json: 'architectures' must be a list of strings, got {archs!r}")
    return "draft" if any(isinstance(a, str) and "Eagle3" in a for a in archs) else "target"


def check_model_type(raw: dict, supported: tuple[str, ...], where: str) -> None:
    for d, at in ((raw, where), (raw.get("text_config"), where + " text_config")):
        if isinstance(d, dict) and "model_type" in d and d["model_type"] not in supported:
            raise ConfigError(f"{at}: unsupported model_type={d['model_type']!r} (jaxspec converts {', '.join(supported)})")


def _header_digest(path: Path) -> str:
    with open(path, "rb") as f:
        raw = f.read(8)
        (n,) = struct.unpack("<Q", raw)
        return hashlib.sha256(raw + f.read(n)).hexdigest()


def source_fingerprint(src: Path, reader: CheckpointReader) -> dict:
    """What a resumed run must find unchanged: the source path, config.json, and every shard's size,
    modification time and header digest (an in-place edit changes the mtime; a re-saved file its header)."""
    files = {}
    for name in ["config.json", *sorted(reader.files)]:
        st = (src / name).stat()
        ident = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
        if name == "config.json":
            ident["sha256"] = hashlib.sha256((src / name).read_bytes()).hexdigest()
        else:
            ident["header_sha256"] = _header_digest(src / name)
        files[name] = ident
    return {"path": str(src.resolve()), "files": files}


def release_host_memory() -> None:
    """Give the freed item back to the OS: glibc keeps freed heap pages, and over 61 layers the
    fragments would add up to more than the one layer the streaming promises. (The item's arrays are
    already freed by reference counting; a gc pass would cost seconds in a process holding torch.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def convert_checkpoint(src: str | Path, dst: str | Path, opts: ConvertOptions = ConvertOptions(),
                       log: Callable[[str], None] = _log, *, lock: bool = True,
                       on_item_saved: Callable[[int], None] | None = None) -> Path:
    """Convert SRC into DST; `lock=False` when the caller already holds DST's lock (DestinationLock).
    `on_item_saved(n)` runs after each converted item of a target, once the n items saved so far are on disk with
    their digests (what a resume would find)."""
    src, dst = Path(src), Path(dst).absolute()
    raw = read_config(src)
    check_destination(src, dst)
    tokenizer_files(src)  # a tokenizer symlink leaving SRC fails now, not after the weights are converted
    with DestinationLock(dst) if lock else contextlib.nullcontext():
        if checkpoint_kind(raw) == "draft":
            return convert_draft(src, dst, raw, opts, log)
        return convert_target(src, dst, raw, opts, log, on_item_saved)


def _source(reader: CheckpointReader, opts: ConvertOptions, bar) -> ObservedSource:
    """The reader as the builders read it: non-finite tensors refused (unless allowed), bytes counted on `bar`."""
    checks = () if opts.allow_nonfinite else (refuse_nonfinite,)
    return ObservedSource(reader, *checks, count_bytes(bar))


def convert_target(src: Path, dst: Path, raw: dict, opts: ConvertOptions, log,
                   on_item_saved: Callable[[int], None] | None = None) -> Path:
    where = str(src / "config.json")
    check_model_type(raw, TARGET_MODEL_TYPES, where)
    cfg = text_config_from_dict(raw, where=where)
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
    try:
        done = [item for item in plan.items if writer.is_done(item)]
        if done:
            log(f"convert: resuming {writer.work}: {len(done)} of {len(plan.items)} items already converted")
        bar = progress_bar(plan.total_bytes, sum(plan.item_bytes[i] for i in done), opts.progress)
        builder = WeightBuilder(_source(reader, opts, bar), cfg, np.dtype(dtype),
                                dequantize_experts=dequantize)
        for item, names in plan.items.items():
            if item in done:
                continue
            builder.used = set()
            tree = builder.item(item)
            check_item_consumed(item, names, builder.used)
            writer.save_item(item, tree)
            del tree
            release_host_memory()
            if on_item_saved is not None:
                writer.wait_for_digests()
                on_item_saved(writer.saved)
        bar.close()
        meta = {
            "kind": "target", "dtype": dtype, "experts": experts, "items": list(plan.items),
            "source": {"path": str(src.resolve()), "quantization": None if cfg.quant is None else cfg.quant.method,
                       "tensors": len(reader.names()), "bytes": plan.total_bytes},
            "skipped": {"vision": len(plan.skipped_vision), "mtp": len(plan.skipped_mtp)},
        }
        if source_fingerprint(src, reader) != options["source"]:
            raise CheckpointError(f"{src}: the source changed while it was being converted; rerun with --restart")
        out = writer.finish(src / "config.json", meta, src)
    except BaseException:
        writer.discard_if_empty()
        raise
    log(f"convert: wrote {out} ({len(plan.items)} items, experts {experts}, dtype {dtype})")
    return out


def convert_draft(src: Path, dst: Path, raw: dict, opts: ConvertOptions, log) -> Path:
    where = str(src / "config.json")
    check_model_type(raw, DRAFT_MODEL_TYPES, where)
    cfg = draft_config_from_dict(raw, where)
    q = raw.get("quantization_config")
    if q:
        raise ConfigError(f"{where}: unsupported quantization_config.quant_method={q.get('quant_method')!r} for an "
                          "EAGLE-3 drafter (drafters are converted from bf16 / f32 weights)")
    dtype = DTYPES[opts.dtype]
    reader = CheckpointReader(src)
    names = plan_draft(reader, cfg, raw)
    options = {"kind": "draft", "dtype": dtype, "source": source_fingerprint(src, reader)}
    total = sum(reader.nbytes(n) for n in names)
    # a drafter is one small item: build (and so validate) it whole before anything is written
    bar = progress_bar(total, 0, opts.progress)
    weights = build_draft(_source(reader, opts, bar), cfg, names, np.dtype(dtype))
    bar.close()
    writer = CheckpointWriter(dst, options, restart=opts.restart, overwrite=opts.overwrite)
    try:
        if not writer.is_done("draft"):
            writer.save_item("draft", weights)
        meta = {"kind": "draft", "dtype": dtype, "experts": None, "items": ["draft"],
                "source": {"path": str(src.resolve()), "tensors": len(names), "bytes": total}}
        out = writer.finish(src / "config.json", meta, src)
    except BaseException:
        writer.discard_if_empty()
        raise
    log(f"convert: wrote {out} (EAGLE-3 drafter, dtype {dtype})")
    return out


__all__ = ["CheckpointError", "ConfigError", "ConvertOptions", "convert_checkpoint"]
