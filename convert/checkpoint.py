"""The converted checkpoint on disk: layout, the resumable writer, and loading onto a mesh.

    DST/
      config.json                the source config.json, verbatim
      jaxspec_checkpoint.json    format version, kind (target / draft), dtype, expert storage, source, items
      weights/<item>/            one orbax StandardCheckpointer item per unit: "embed", "layer_000".., "head"
      weights/<item>.json        its tree schema (node types, shapes, dtypes); written after the item is saved
      tokenizer / chat template / generation_config files of the source
      CONVERSION_COMPLETE        written last

A conversion writes into DST.partial and renames it to DST only when everything, marker included, is
there; loading refuses a directory without the marker. Each item is its own orbax checkpoint, so a
rerun after an interruption keeps every item whose schema file exists and redoes the rest.

jaxspec_checkpoint.json's `manifest` lists every other file (the marker aside) with its size and SHA-256,
hashed as it was written (convert/integrity.py). Loading checks presence and sizes, or every digest with
`verify="full"`. Checkpoints written before the manifest existed load unverified.

Replacing (`overwrite`) and discarding (`restart`) only ever remove a directory that is a jaxspec
checkpoint or a conversion's DST.partial: never anything the converter did not write.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from convert import tree_schema
from convert.destination import partial_dir, replaced_dir
from convert.errors import CheckpointError
from convert.hf_config import draft_config_to_hf, text_config_to_hf
from convert.integrity import describe_files, describe_tree, verify_manifest
from convert.json_input import parse_json
from convert.tokenizer_files import copy_tokenizer_files
from model.config import TextConfig, load_text_config
from model.attention_mla import split_input_projections
from model.decoder import KimiWeights, split_attention_inputs
from model.eagle3 import DraftConfig, DraftWeights, load_draft_config
from model.moe import MoEWeights
from model.quant import Fp8Weight, Int4Weight
from model.sharding import TARGET_RULES, path_str, shardings_for

FORMAT = "jaxspec-checkpoint"
# v2: each MLA layer's `attn.w_uk` is stored [N, C, Dn] (v1: [N, Dn, C], kv_b_proj's order, which XLA transposed
# at every dispatch of a step). v1 checkpoints still load: `w_uk` is transposed once, on load.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
METADATA_FILE = "jaxspec_checkpoint.json"
COMPLETE_MARKER = "CONVERSION_COMPLETE"
OPTIONS_FILE = "convert_options.json"  # in DST.partial only: what the unfinished conversion was started with
WEIGHTS_DIR = "weights"
# float32 on purpose (routing decisions are made in float32): never cast on load
KEEP_DTYPE_PATTERN = re.compile(r"\.mlp\.(router|router_bias)$")
ITEM_NAME = re.compile(r"embed|head|draft|layer_\d{3,}")
VERIFY_LEVELS = ("sizes", "full")


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------------
def is_checkpoint_dir(path: Path) -> bool:
    """A directory a jaxspec conversion wrote (complete or not): what `overwrite` may replace."""
    if path.is_symlink() or not path.is_dir():
        return False
    return (path / COMPLETE_MARKER).is_file() or (path / METADATA_FILE).is_file() or (path / OPTIONS_FILE).is_file()


def _read_json(path: Path, what: str):
    try:
        return parse_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e})") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: {what} is a directory") from None


def describe_source_change(started, now) -> str | None:
    """How the source of an unfinished conversion differs from today's (None: the same)."""
    if started == now:
        return None
    if not (isinstance(started, dict) and isinstance(now, dict)):
        return f"source {started!r} is now {now!r}"
    if started.get("path") != now.get("path"):
        return f"source path {started.get('path')} is now {now.get('path')}"
    a, b = started.get("files") or {}, now.get("files") or {}
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"shard {name} is gone"
        if name not in a:
            return f"shard {name} is new"
        if a[name] != b[name]:
            what = [k for k in sorted(set(a[name]) | set(b[name]))
                    if not isinstance(a[name], dict) or a[name].get(k) != b[name].get(k)]
            return f"shard {name} changed ({', '.join(what) or 'identity'})"
    return "the source's description changed"


class CheckpointWriter:
    """Writes items into DST.partial; `finish` makes DST appear in one rename."""

    def __init__(self, dst: str | Path, options: dict, *, restart: bool = False, overwrite: bool = False):
        self.dst = Path(dst).absolute()  # orbax refuses relative paths
        self.work = partial_dir(self.dst)
        self.overwrite = overwrite
        options = json.loads(json.dumps({**options, "format_version": FORMAT_VERSION}))  # never resume another layout
        if self.dst.exists() or self.dst.is_symlink():
            if not overwrite:
                raise CheckpointError(f"{self.dst}: already exists (pass --overwrite to replace it)")
            if not is_checkpoint_dir(self.dst):
                raise CheckpointError(f"{self.dst}: not a jaxspec checkpoint, so --overwrite will not replace it "
                                      "(remove it yourself, or choose another destination)")
            # `finish` moves the old checkpoint there: anything else in the way would fail that rename only after
            # the whole conversion, leaving a finished DST.partial that cannot be resumed
            aside = replaced_dir(self.dst)
            if (aside.exists() or aside.is_symlink()) and not is_checkpoint_dir(aside):
                raise CheckpointError(f"{aside}: not a jaxspec checkpoint, and --overwrite moves the old checkpoint "
                                      "there while the new one takes its place (remove it yourself)")
        if self.work.is_symlink() or (self.work.exists() and not self.work.is_dir()):
            raise CheckpointError(f"{self.work}: exists and is not a conversion's work directory; remove it yourself")
        if self.work.exists() and restart:
            if not is_checkpoint_dir(self.work) and not (self.work / WEIGHTS_DIR).is_dir():
                raise CheckpointError(f"{self.work}: not a conversion's work directory, so --restart will not remove it")
            shutil.rmtree(self.work)
        self.created = not self.work.exists()
        if not self.created:
            opts = self.work / OPTIONS_FILE
            if not opts.is_file():
                raise CheckpointError(f"{self.work}: an unfinished conversion without {OPTIONS_FILE} cannot be resumed; "
                                      "pass --restart to discard it")
            started = _read_json(opts, "the unfinished conversion's options")
            if not isinstance(started, dict):
                started = {"options": started}
            change = describe_source_change(started.get("source"), options.get("source"))
            if change is not None and "format_version" in started and started.get("kind") == options.get("kind"):
                raise CheckpointError(f"{self.work}: the source changed since this unfinished conversion started "
                                      f"({change}); pass --restart to convert it afresh")
            if started != options:
                raise CheckpointError(
                    f"{self.work}: an unfinished conversion with other options is there "
                    f"({started} vs {options}); pass --restart to discard it"
                )
        else:
            (self.work / WEIGHTS_DIR).mkdir(parents=True)
            _write_json_atomic(self.work / OPTIONS_FILE, options)
        self.saved = 0
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-digests")
        self._pending = None

    def item_dir(self, item: str) -> Path:
        return self.work / WEIGHTS_DIR / item

    def schema_file(self, item: str) -> Path:
        return self.work / WEIGHTS_DIR / (item + ".json")

    def is_done(self, item: str) -> bool:
        return self.schema_file(item).exists() and self.item_dir(item).is_dir()

    def _clear(self, item: str) -> None:
        """Remove what a killed run left of `item` (a half-written orbax dir or its temporary dirs)."""
        self.schema_file(item).unlink(missing_ok=True)
        for p in (self.work / WEIGHTS_DIR).glob(item + "*"):
            if p.is_dir() and (p.name == item or p.name.startswith(item + ".")):
                shutil.rmtree(p)

    def save_item(self, item: str, tree) -> int:
        """Save one item (numpy or jax arrays); returns its bytes. The schema file, written last with the
        digests of the item's files, marks it done."""
        self._clear(item)
        flat = tree_schema.flat_arrays(tree)
        # a checkpointer per item, closed after it: nothing of an item outlives its save
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(self.item_dir(item), flat)
                checkpointer.wait_until_finished()
        except ValueError as e:  # tensorstore reports a full or read-only disk as a ValueError
            raise CheckpointError(f"{self.item_dir(item)}: cannot write item {item!r} "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        nbytes = int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in flat.values()))
        schema = {"item": item, "tree": tree_schema.describe(tree), "bytes": nbytes}
        # hash the item's files (still in the page cache) on a thread while the next item is built: hashlib
        # releases the GIL, so the digests cost little wall time. The schema file, written after the digests,
        # still marks the item done; at most one item is pending.
        self.wait_for_digests()
        self._pending = self._hasher.submit(self._write_schema, item, schema)
        self.saved += 1
        return nbytes

    def _write_schema(self, item: str, schema: dict) -> None:
        schema["files"] = describe_tree(self.work, self.item_dir(item))
        _write_json_atomic(self.schema_file(item), schema)

    def wait_for_digests(self) -> None:
        """Block until the last saved item's digests and schema file are written (raises what that raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait_for_digests()
        self._hasher.shutdown()

    def discard_if_empty(self) -> None:
        """After a failure: remove DST.partial if this run created it and saved nothing into it."""
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the failure being handled is the one to report
            pass
        if self.created and self.saved == 0 and self.work.is_dir():
            shutil.rmtree(self.work, ignore_errors=True)

    def _manifest(self, items: list[str], extra: list[Path]) -> dict:
        manifest = {}
        for item in items:
            if not self.is_done(item):
                raise CheckpointError(f"{self.item_dir(item)}: item {item!r} was never saved; the conversion is "
                                      "incomplete (rerun it to resume)")
            schema = _read_json(self.schema_file(item), f"schema of item {item!r}")
            files = schema.get("files") if isinstance(schema, dict) else None
            # an item saved by a converter from before the manifest existed: hash it now
            manifest.update(files if isinstance(files, dict) else describe_tree(self.work, self.item_dir(item)))
        manifest.update(describe_files(self.work, [self.schema_file(i) for i in items] + extra))
        return manifest

    def finish(self, config: dict | Path, metadata: dict, tokenizer_dir: str | Path | None = None) -> Path:
        """Config, metadata with the manifest, tokenizer files, then the marker, then the rename DST.partial -> DST."""
        self.close()
        if isinstance(config, Path):
            shutil.copyfile(config, self.work / "config.json")
        else:
            (self.work / "config.json").write_text(json.dumps(config, indent=2))
        copied = copy_tokenizer_files(tokenizer_dir, self.work) if tokenizer_dir is not None else []
        manifest = self._manifest(list(metadata.get("items", [])), [self.work / n for n in ["config.json", *copied]])
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "tokenizer_files": copied, **metadata,
                "manifest": manifest}
        _write_json_atomic(self.work / METADATA_FILE, meta)
        (self.work / COMPLETE_MARKER).write_text("complete\n")
        old = replaced_dir(self.dst)
        if self.dst.exists() and self.overwrite:
            # the old checkpoint goes aside first, then the new one takes its place: between the two renames DST is
            # absent, the old checkpoint whole at DST.replaced and the new one at DST.partial, which a rerun finishes
            # (its options file stays until the rename, so the rerun can tell it is the same conversion)
            if is_checkpoint_dir(old):
                shutil.rmtree(old)
            os.replace(self.dst, old)
        os.replace(self.work, self.dst)
        (self.dst / OPTIONS_FILE).unlink(missing_ok=True)
        if self.overwrite and is_checkpoint_dir(old):  # this run's, or a run stopped between the two renames
            shutil.rmtree(old)
        return self.dst


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def expert_storage(weights: KimiWeights) -> str:
    """"int4", "fp8", a dense dtype name, or "none" when the model has no MoE layer."""
    for layer in weights.layers:
        if isinstance(layer.mlp, MoEWeights):
            gate = layer.mlp.experts.gate
            if isinstance(gate, Int4Weight):
                return "int4"
            if isinstance(gate, Fp8Weight):
                return "fp8"
            return dtype_name(gate.dtype)
    return "none"


def split_kimi_weights(w: KimiWeights) -> dict:
    """KimiWeights -> its conversion items, in order."""
    items = {"embed": w.embed}
    for i, layer in enumerate(w.layers):
        items[f"layer_{i:03d}"] = layer
    items["head"] = {"final_norm": w.final_norm, "lm_head": w.lm_head}
    return items


def assemble_kimi_weights(items: dict) -> KimiWeights:
    layers = sorted(k for k in items if k.startswith("layer_"))
    return KimiWeights(
        embed=items["embed"],
        layers=tuple(items[k] for k in layers),
        final_norm=items["head"]["final_norm"],
        lm_head=items["head"]["lm_head"],
    )


def save_target(path: str | Path, weights: KimiWeights, config: TextConfig | dict, *,
                tokenizer_dir: str | Path | None = None, source: str = "in-memory weights",
                overwrite: bool = False) -> Path:
    """Save in-memory target weights (numpy or jax arrays, any sharding) as a complete checkpoint; weights in the
    engines' run layout (q_a and kv_a fused) are stored apart again, as every checkpoint stores them."""
    weights = split_attention_inputs(weights)
    raw = config if isinstance(config, dict) else text_config_to_hf(config)
    writer = CheckpointWriter(path, {"kind": "target", "source": source}, restart=True, overwrite=overwrite)
    items = split_kimi_weights(weights)
    for name, tree in items.items():
        writer.save_item(name, tree)
    meta = {"kind": "target", "dtype": dtype_name(weights.embed.dtype), "experts": expert_storage(weights),
            "source": {"path": source}, "items": list(items)}
    return writer.finish(raw, meta, tokenizer_dir)


def save_draft(path: str | Path, weights: DraftWeights, config: DraftConfig | dict, *,
               tokenizer_dir: str | Path | None = None, source: str = "in-memory weights",
               overwrite: bool = False) -> Path:
    """Save in-memory EAGLE-3 draft weights as a complete checkpoint (one item, "draft"); an MLA draft's fused q_a
    and kv_a (the engines' run layout) are stored apart again."""
    if weights.mla is not None:
        weights = weights.replace(mla=split_input_projections(weights.mla))
    raw = config if isinstance(config, dict) else draft_config_to_hf(config)
    writer = CheckpointWriter(path, {"kind": "draft", "source": source}, restart=True, overwrite=overwrite)
    writer.save_item("draft", weights)
    meta = {"kind": "draft", "dtype": dtype_name(weights.fc.dtype), "experts": None,
            "source": {"path": source}, "items": ["draft"]}
    return writer.finish(raw, meta, tokenizer_dir)


# ------------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------------
def read_metadata(path: str | Path, kind: str | None = None) -> dict:
    path = Path(path).absolute()  # orbax refuses relative paths
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a converted checkpoint is one)")
    if not (path / COMPLETE_MARKER).exists():
        hint = " (an interrupted conversion? rerun `python -m convert` to resume it)" if partial_dir(path).exists() else ""
        raise CheckpointError(f"{path}: not a complete jaxspec checkpoint: {COMPLETE_MARKER} is missing{hint}")
    meta = _read_json(path / METADATA_FILE, "checkpoint metadata")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path / METADATA_FILE}: checkpoint metadata is not a JSON object")
    if meta.get("format") != FORMAT or meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path / METADATA_FILE}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
            f"{FORMAT!r} v{' / v'.join(map(str, READABLE_VERSIONS))}"
        )
    if kind is not None and meta.get("kind") != kind:
        raise CheckpointError(f"{path}: holds a {meta.get('kind')} checkpoint, not a {kind}")
    items = meta.get("items")
    if not isinstance(items, list) or not all(isinstance(i, str) and ITEM_NAME.fullmatch(i) for i in items):
        raise CheckpointError(f"{path / METADATA_FILE}: 'items' must list item names (embed, layer_000.., head, draft)")
    return meta


def verify_checkpoint(path: str | Path, meta: dict, level: str = "sizes", items=None) -> None:
    """Compare the checkpoint's files with its manifest: presence and sizes ("sizes") or every SHA-256 ("full").
    `items` restricts the check to those items' files (and the files beside the weights)."""
    if level not in VERIFY_LEVELS:
        raise ValueError(f"verify level {level!r}: choose one of {VERIFY_LEVELS}")
    path = Path(path).absolute()
    manifest = meta.get("manifest")
    if manifest is None:  # written before checkpoints carried a manifest
        return
    only = None
    if items is not None:
        wanted = {f"{WEIGHTS_DIR}/{i}" for i in items} | {f"{WEIGHTS_DIR}/{i}.json" for i in items}
        only = lambda name: (not name.startswith(WEIGHTS_DIR + "/") or name in wanted  # noqa: E731
                             or "/".join(name.split("/")[:2]) in wanted)
    problems = verify_manifest(path, manifest, full=level == "full", only=only)
    if isinstance(manifest, dict):
        for item in meta["items"] if items is None else items:
            if f"{WEIGHTS_DIR}/{item}.json" not in manifest:
                problems.append(f"{path / WEIGHTS_DIR / (item + '.json')}: item {item!r} is not in the manifest")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(f"{problems[0]}{more}")


def item_schema(path: Path, item: str):
    doc = _read_json(path / WEIGHTS_DIR / (item + ".json"), f"schema of item {item!r}")
    if not isinstance(doc, dict) or not isinstance(doc.get("tree"), dict):
        raise CheckpointError(f"{path / WEIGHTS_DIR / (item + '.json')}: not a weight schema (no 'tree' object)")
    return doc["tree"]


def abstract_item(path: Path, item: str):
    """The item's abstract tree from its schema, every structural problem as a CheckpointError."""
    try:
        return tree_schema.abstract(item_schema(path, item))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path / WEIGHTS_DIR / (item + '.json')}: malformed weight schema ({e!r})") from None


def _is_quant_container(x) -> bool:
    return isinstance(x, (Int4Weight, Fp8Weight))


DEFAULT_LOAD_DTYPE = jnp.bfloat16
KEEP_STORED = "stored"


def load_dtypes(abstract_tree, dtype):
    """Abstract tree with float leaves cast to `dtype` (None: bfloat16); INT4 words + scales, FP8 bytes +
    scales, the router and integer tensors (d2t) keep their stored dtype. `dtype="stored"` casts nothing."""
    if isinstance(dtype, str) and dtype == KEEP_STORED:
        return abstract_tree
    dtype = jnp.dtype(DEFAULT_LOAD_DTYPE if dtype is None else dtype)

    def one(path, node):
        if _is_quant_container(node) or KEEP_DTYPE_PATTERN.search("." + path_str(path)):
            return node
        if jnp.issubdtype(node.dtype, jnp.floating) and node.dtype != ml_dtypes.float8_e4m3fn:
            return jax.ShapeDtypeStruct(node.shape, dtype)
        return node

    return jax.tree_util.tree_map_with_path(one, abstract_tree, is_leaf=_is_quant_container)


def _restore_item(path: Path, item: str, abstract_item, shardings_item):
    targets = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_item, shardings_item
    )
    flat_targets = tree_schema.flat_arrays(targets)
    if not flat_targets:
        return abstract_item
    try:
        restored = ocp.StandardCheckpointer().restore(path / WEIGHTS_DIR / item, flat_targets)
        return tree_schema.unflatten(targets, restored)
    except (OSError, ValueError, KeyError, TypeError) as e:  # orbax / tensorstore on damaged or mismatched files
        raise CheckpointError(f"{path / WEIGHTS_DIR / item}: cannot restore item {item!r} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _upgrade_layer_v1(layer, swap):
    """A layer item saved by format v1 -> the current layout (`attn.w_uk` [N, Dn, C] -> [N, C, Dn])."""
    return layer.replace(attn=layer.attn.replace(w_uk=swap(layer.attn.w_uk)))


def _swap_last_axes_on_device(a: jax.Array) -> jax.Array:
    return jax.jit(lambda x: jnp.swapaxes(x, 1, 2), out_shardings=a.sharding)(a)


def _default_shardings(tree):
    device = jax.devices()[0]
    return jax.tree_util.tree_map(lambda _: SingleDeviceSharding(device), tree)


def load_target(path: str | Path, mesh: Mesh | None = None, dtype=None,
                verify: str = "sizes") -> tuple[TextConfig, KimiWeights]:
    """Restore a converted target straight into NamedShardings (TARGET_RULES on `mesh`), or onto the
    default device without a mesh. `dtype` casts dense float weights (None: bfloat16; "stored": no cast).
    `verify`: "sizes" checks the manifest's files are there with their sizes, "full" every digest too."""
    path = Path(path).absolute()  # orbax refuses relative paths
    meta = read_metadata(path, "target")
    verify_checkpoint(path, meta, verify)
    cfg = load_text_config(path)
    items = meta["items"]
    if sorted(k for k in items if not k.startswith("layer_")) != ["embed", "head"]:
        raise CheckpointError(f"{path / METADATA_FILE}: a target's items are embed, layer_000.. and head, not {items}")
    abstract_w = load_dtypes(assemble_kimi_weights({k: abstract_item(path, k) for k in items}), dtype)
    if len(abstract_w.layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"{path}: {len(abstract_w.layers)} layers saved, config.json says {cfg.num_hidden_layers}")
    shardings = shardings_for(abstract_w, mesh, TARGET_RULES) if mesh is not None else _default_shardings(abstract_w)
    abstract_items, sharding_items = split_kimi_weights(abstract_w), split_kimi_weights(shardings)
    restored = {k: _restore_item(path, k, abstract_items[k], sharding_items[k]) for k in items}
    if meta["format_version"] == 1:
        restored = {k: _upgrade_layer_v1(v, _swap_last_axes_on_device) if k.startswith("layer_") else v
                    for k, v in restored.items()}
    return cfg, assemble_kimi_weights(restored)


def load_draft(path: str | Path, mesh: Mesh | None = None, dtype=None,
               verify: str = "sizes") -> tuple[DraftConfig, DraftWeights]:
    """Restore a converted EAGLE-3 draft, replicated over `mesh` (or on the default device); `dtype` and
    `verify` as for `load_target`."""
    path = Path(path).absolute()  # orbax refuses relative paths
    meta = read_metadata(path, "draft")
    verify_checkpoint(path, meta, verify)
    cfg = load_draft_config(path)
    abstract_w = load_dtypes(abstract_item(path, "draft"), dtype)
    if mesh is not None:
        shardings = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), abstract_w)
    else:
        shardings = _default_shardings(abstract_w)
    return cfg, _restore_item(path, "draft", abstract_w, shardings)


def load_item_numpy(path: str | Path, item: str):
    """One item as host numpy arrays in its stored dtypes (the check mode; no device involved)."""
    path = Path(path).absolute()  # orbax refuses relative paths
    like = abstract_item(path, item)
    keys = tree_schema.flat_arrays(like)
    args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys}
    try:
        flat = ocp.PyTreeCheckpointer().restore(path / WEIGHTS_DIR / item, args=ocp.args.PyTreeRestore(restore_args=args))
        tree = tree_schema.unflatten(like, flat)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path / WEIGHTS_DIR / item}: cannot restore item {item!r} ({type(e).__name__})") from None
    if item.startswith("layer_") and read_metadata(path)["format_version"] == 1:
        tree = _upgrade_layer_v1(tree, lambda a: np.ascontiguousarray(np.swapaxes(a, 1, 2)))
    return tree
