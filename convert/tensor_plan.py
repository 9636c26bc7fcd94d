"""Check a checkpoint's tensor headers against its config before any weight is read, and group the
tensors into conversion items (embeddings, one item per layer, head).

Everything here reads only safetensors headers, so a bad checkpoint fails in seconds with one message
naming the file and tensor, not an hour into a 600 GB conversion.
"""

from __future__ import annotations

import dataclasses
import re

import ml_dtypes
import numpy as np

from convert.kimi_tensors import LinearSpec, PlainSpec, TensorSpec, target_items
from convert.safetensors_reader import CheckpointError, CheckpointReader
from model.config import TextConfig

FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# tensors only a multi-token-prediction (MTP) layer has
MTP_MARKERS = ("eh_proj.", "enorm.", "hnorm.", "shared_head.")


@dataclasses.dataclass
class TargetPlan:
    items: dict[str, list[str]]  # item -> every source tensor it consumes
    item_bytes: dict[str, int]
    expert_storage: str  # "int4", "fp8", "dense" or "none" (no MoE layer)
    skipped_vision: list[str]
    skipped_mtp: list[str]

    @property
    def total_bytes(self) -> int:
        return sum(self.item_bytes.values())


def is_ignored(module: str, ignore: tuple[str, ...], prefix: str) -> bool:
    """compressed-tensors' ignore list: exact module names or "re:" patterns (re.match); K2.5 lists them
    without the `language_model.` prefix, so both spellings are tried."""
    names = {module, module.removeprefix(prefix)}
    for pattern in ignore:
        if pattern.startswith("re:"):
            if any(re.match(pattern[3:], n) for n in names):
                return True
        elif pattern in names:
            return True
    return False


class _Checker:
    def __init__(self, reader: CheckpointReader, cfg: TextConfig, mtp_layers_declared: int):
        self.reader, self.cfg = reader, cfg
        self.mtp_layers_declared = mtp_layers_declared  # config.json num_nextn_predict_layers

    def where(self, name: str) -> str:
        return str(self.reader.file_of(name))

    def fail(self, name: str, message: str):
        raise CheckpointError(f"{self.where(name)}: tensor '{name}' {message}")

    def require(self, name: str, shape: tuple[int, ...], dtypes, what: str) -> str:
        if not self.reader.has(name):
            raise CheckpointError(self.missing_message(name))
        got = tuple(self.reader.shape(name))
        if got != tuple(shape):
            self.fail(name, f"has shape {list(got)}, config.json expects {list(shape)}")
        dt = self.reader.dtype(name)
        if dt not in dtypes:
            self.fail(name, f"has dtype {dt}, expected {what}")
        return name

    def missing_message(self, name: str) -> str:
        loc = self.reader.index_path or self.reader.directory
        m = re.match(rf"^{re.escape(self.cfg.weight_prefix)}model\.layers\.(\d+)\.", name)
        if m:
            held = self.layers_held()
            if int(m.group(1)) >= held:
                return (f"{loc}: missing tensor '{name}': config.json num_hidden_layers="
                        f"{self.cfg.num_hidden_layers} but the weights hold {held} layers")
        return f"{loc}: missing tensor '{name}'"

    def layers_held(self) -> int:
        pat = re.compile(rf"^{re.escape(self.cfg.weight_prefix)}model\.layers\.(\d+)\.")
        ids = {int(m.group(1)) for n in self.reader.names() if (m := pat.match(n))}
        return max(ids) + 1 if ids else 0

    # --- one spec -> the tensor names it consumes ---------------------------------------------------
    def plain(self, spec: PlainSpec) -> list[str]:
        return [self.require(spec.name, spec.shape, FLOAT_DTYPES, "a float dtype (f32 / bf16 / f16)")]

    def linear(self, spec: LinearSpec) -> tuple[str, list[str]]:
        """-> (storage "int4" / "fp8" / "dense", tensor names)."""
        m, out, inp, q = spec.module, spec.out, spec.inp, self.cfg.quant
        r = self.reader
        if r.has(m + ".weight_packed"):
            if q is None or q.method != "int4":
                self.fail(m + ".weight_packed", f"is INT4 (compressed-tensors) but config.json declares "
                          f"{'no quantization' if q is None else repr(q.method)}")
            if is_ignored(m, q.ignore, self.cfg.weight_prefix):
                self.fail(m + ".weight_packed", "is INT4 but config.json quantization_config.ignore excludes this module")
            if inp % 8 or inp % q.group_size:
                self.fail(m + ".weight_packed", f"input dim {inp} is not a multiple of 8 and group_size {q.group_size}")
            names = [
                self.require(m + ".weight_packed", (out, inp // 8), {np.dtype(np.int32), np.dtype(np.uint32)}, "int32"),
                self.require(m + ".weight_scale", (out, inp // q.group_size), FLOAT_DTYPES, "a float dtype"),
            ]
            if r.has(m + ".weight_shape"):
                ints = {np.dtype(t) for t in (np.int64, np.int32, np.int16, np.uint64, np.uint32)}
                names.append(self.require(m + ".weight_shape", (2,), ints, "an integer dtype"))
            if r.has(m + ".weight"):
                self.fail(m + ".weight", "sits beside an INT4 weight_packed of the same module")
            return "int4", names
        if r.has(m + ".weight_scale_inv"):
            if q is None or q.method != "fp8":
                self.fail(m + ".weight_scale_inv", f"is an FP8 block scale but config.json declares "
                          f"{'no quantization' if q is None else repr(q.method)}")
            bo, bi = q.block_size
            names = [
                self.require(m + ".weight", (out, inp), {FP8}, "float8_e4m3fn (it has a weight_scale_inv)"),
                self.require(m + ".weight_scale_inv", (-(-out // bo), -(-inp // bi)), FLOAT_DTYPES, "float32"),
            ]
            return "fp8", names
        name = m + ".weight"
        if r.has(name) and r.dtype(name) == FP8:
            self.fail(name, f"is float8_e4m3fn but '{m}.weight_scale_inv' is missing")
        self.require(name, (out, inp), FLOAT_DTYPES, "a float dtype (f32 / bf16 / f16)")
        if q is not None and q.method == "int4" and not is_ignored(m, q.ignore, self.cfg.weight_prefix):
            self.fail(name, f"is {r.dtype(name)}, but config.json quantization_config quantizes this module to INT4 "
                      "(it is not in the ignore list)")
        return "dense", [name]

    # --- names nobody consumes ---------------------------------------------------------------------
    def classify_leftover(self, name: str, vision: list[str], mtp: list[str]) -> None:
        c = self.cfg
        if name.startswith(VISION_PREFIXES):
            vision.append(name)
            return
        m = re.match(rf"^{re.escape(c.weight_prefix)}model\.layers\.(\d+)\.(.*)$", name)
        if m and int(m.group(1)) >= c.num_hidden_layers:
            if self.is_mtp_layer(int(m.group(1))):
                mtp.append(name)
                return
            self.fail(name, f"belongs to layer {m.group(1)}, but config.json num_hidden_layers={c.num_hidden_layers}")
        e = re.search(r"\.mlp\.experts\.(\d+)\.", name)
        if e and int(e.group(1)) >= c.n_routed_experts:
            self.fail(name, f"belongs to expert {e.group(1)}, but config.json n_routed_experts={c.n_routed_experts}")
        self.fail(name, "is unknown: not a tensor of a DeepseekV3 / Kimi K2 checkpoint with this config.json")

    def is_mtp_layer(self, layer: int) -> bool:
        """DeepSeek-style MTP layers sit right after the decoder layers and have eh_proj / enorm / hnorm
        (a plain extra decoder layer is a config / weights disagreement, not MTP)."""
        c = self.cfg
        if not c.num_hidden_layers <= layer < c.num_hidden_layers + max(1, self.mtp_layers_declared):
            return False
        p = f"{c.weight_prefix}model.layers.{layer}."
        return any(n.startswith(p) and n[len(p):].startswith(MTP_MARKERS) for n in self.reader.names())


def plan_target(reader: CheckpointReader, cfg: TextConfig, num_nextn_predict_layers: int = 0) -> TargetPlan:
    check = _Checker(reader, cfg, num_nextn_predict_layers)
    items: dict[str, list[str]] = {}
    expert_kinds: dict[str, str] = {}
    for item, specs in target_items(cfg).items():
        names: list[str] = []
        for spec in specs:
            if isinstance(spec, PlainSpec):
                names += check.plain(spec)
                continue
            kind, got = check.linear(spec)
            names += got
            if spec.role == "expert":
                expert_kinds.setdefault(kind, spec.module)
        items[item] = names
    if len(expert_kinds) > 1:
        a, b = sorted(expert_kinds)[:2]
        m = expert_kinds[b]
        raise CheckpointError(
            f"{check.where(_first_tensor(reader, m))}: expert '{m}' is stored as {b}, "
            f"while expert '{expert_kinds[a]}' is {a}: all routed experts must share one format"
        )
    consumed = {n for names in items.values() for n in names}
    vision: list[str] = []
    mtp: list[str] = []
    for name in reader.names():
        if name not in consumed:
            check.classify_leftover(name, vision, mtp)
    return TargetPlan(
        items=items,
        item_bytes={k: sum(reader.nbytes(n) for n in v) for k, v in items.items()},
        expert_storage=next(iter(expert_kinds), "none"),
        skipped_vision=vision,
        skipped_mtp=mtp,
    )


def _first_tensor(reader: CheckpointReader, module: str) -> str:
    return next(n for n in reader.names() if n.startswith(module + "."))


def check_item_consumed(item: str, planned: list[str], used: set[str]) -> None:
    """The builder must read exactly what the plan validated (guards the two tables against drift)."""
    if set(planned) != used:
        raise AssertionError(
            f"internal error in {item}: builder read {sorted(used - set(planned))[:3]} beyond the plan, "
            f"missed {sorted(set(planned) - used)[:3]}"
        )
