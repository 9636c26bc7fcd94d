"""Hostile checkpoints and destinations, each built from a good tiny one: `python -m convert` answers every one with
a single line `convert: error: ...` naming the file, tensor, key or flag, exit status 2, no DST, and SRC untouched.

CASES is also what the before / after table of issue 33 was measured with (each case run against main's code)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert.__main__ import main
from convert.destination import check_destination
from convert.errors import CheckpointError
from tests import convert_fixtures as fx


@pytest.fixture(scope="module")
def base_src(tmp_path_factory):
    """A bf16 2-layer checkpoint (1 dense + 1 MoE), sharded by save_pretrained itself."""
    root = tmp_path_factory.mktemp("hostile")
    model = fx.make_hf_model(5, **{**fx.CONVERT_TINY, "num_hidden_layers": 2})
    fx.round_model_to_bf16_(model)
    model.to(torch.bfloat16).save_pretrained(root, safe_serialization=True, max_shard_size="150KB")
    fx.write_tokenizer_files(root)
    return root


@pytest.fixture(scope="module")
def base_draft(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_draft")
    fx.drafter_checkpoint(root)
    return root


# ----------------------------------------------------------------------------------------------------------------
# building blocks for the cases
# ----------------------------------------------------------------------------------------------------------------
def index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def write_index(src: Path, idx) -> None:
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))


def shard_of(src: Path, tensor: str = "model.layers.1.mlp.gate.weight") -> Path:
    return src / index(src)["weight_map"][tensor]


def edit_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: Path, header, data: bytes, header_text: str | None = None) -> None:
    text = (header_text if header_text is not None else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(edit: Callable[[dict], None], tensor: str = "model.layers.1.mlp.gate.weight"):
    """A case mutation: apply `edit(header)` to the shard holding `tensor`, data bytes unchanged."""
    def mutate(src: Path, tmp: Path) -> None:
        path = shard_of(src, tensor)
        header, data = read_safetensors(path)
        edit(header)
        write_safetensors(path, header, data)
    return mutate


def first_two(header: dict) -> tuple[str, str]:
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return names[0], names[1]


def negative_offsets(h):  # header bytes become weights: data_offsets [-L, 0] with a shape of L bytes
    a, _ = first_two(h)
    n = h[a]["data_offsets"][1] - h[a]["data_offsets"][0]
    h[a]["data_offsets"] = [-n, 0]


def overlapping_offsets(h):
    a, b = first_two(h)
    size_b = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size_b]


def wrong_byte_count(h):
    a, _ = first_two(h)
    h[a]["shape"] = [h[a]["shape"][0] + 1] + h[a]["shape"][1:]


def nan_in(tensor: str):
    def mutate(src: Path, tmp: Path) -> None:
        path = shard_of(src, tensor)
        tensors = load_file(path)
        tensors[tensor] = tensors[tensor].clone()
        tensors[tensor].view(-1)[3] = float("nan")
        save_file(tensors, path, metadata={"format": "pt"})
    return mutate


def outside_secret(tmp: Path) -> Path:
    secret = tmp / "secret.txt"
    secret.write_text("root:$6$very-secret-hash:19000:0:99999:7:::\n")
    return secret


def tokenizer_symlink(src: Path, tmp: Path) -> None:
    (src / "tiktoken.model").unlink()
    (src / "tiktoken.model").symlink_to(outside_secret(tmp))


def index_traversal(src: Path, tmp: Path) -> None:
    shard = shard_of(src)
    shutil.copy(shard, tmp / "outside.safetensors")
    idx = index(src)
    idx["weight_map"] = {k: ("../outside.safetensors" if v == shard.name else v) for k, v in idx["weight_map"].items()}
    write_index(src, idx)


def shard_symlink(src: Path, tmp: Path) -> None:
    shard = shard_of(src)
    shutil.move(shard, tmp / "elsewhere.safetensors")
    shard.symlink_to(tmp / "elsewhere.safetensors")


def index_shard_is_directory(src: Path, tmp: Path) -> None:
    idx = index(src)
    (src / "subdir").mkdir()
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "subdir"
    write_index(src, idx)


def weight_map(value):
    def mutate(src: Path, tmp: Path) -> None:
        idx = index(src)
        idx["weight_map"] = value(idx["weight_map"])
        write_index(src, idx)
    return mutate


def src_is_file(src: Path, tmp: Path) -> None:
    shutil.rmtree(src)
    src.write_text("not a directory\n")


def config_text(text: str):
    def mutate(src: Path, tmp: Path) -> None:
        (src / "config.json").write_text(text)
    return mutate


def config(**changes):
    return lambda src, tmp: edit_config(src, **changes)


def dst_is_a_file(src: Path, tmp: Path) -> None:
    (tmp / "dst").write_text("my notes\n")


def dst_is_a_user_directory(src: Path, tmp: Path) -> None:
    (tmp / "dst").mkdir()
    (tmp / "dst" / "thesis.tex").write_text("years of work\n")


def partial_not_ours(src: Path, tmp: Path) -> None:
    (tmp / "dst.partial").mkdir()
    (tmp / "dst.partial" / "photos.txt").write_text("keep me\n")


def raw_header(text: str):
    def mutate(src: Path, tmp: Path) -> None:
        path = shard_of(src)
        _, data = read_safetensors(path)
        write_safetensors(path, None, data, header_text=text)
    return mutate


def huge_header_length(src: Path, tmp: Path) -> None:
    path = shard_of(src)
    raw = bytearray(path.read_bytes())
    raw[:8] = struct.pack("<Q", 2**62)
    path.write_bytes(bytes(raw))


def trailing_bytes(src: Path, tmp: Path) -> None:
    with open(shard_of(src), "ab") as f:
        f.write(b"\0" * 16)


def duplicate_key(src: Path, tmp: Path) -> None:
    path = shard_of(src)
    header, data = read_safetensors(path)
    text = json.dumps(header)
    a, _ = first_two(header)
    dup = json.dumps({a: header[a]})[1:-1]
    write_safetensors(path, None, data, header_text=text[:-1] + ", " + dup + "}")


def draft_config(**eagle):
    def mutate(src: Path, tmp: Path) -> None:
        cfg = json.loads((src / "config.json").read_text())
        cfg["eagle_config"].update(eagle)
        (src / "config.json").write_text(json.dumps(cfg))
    return mutate


def draft_d2t_out_of_range(src: Path, tmp: Path) -> None:
    tensors = load_file(src / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + 1000
    tensors.pop("t2d")
    save_file(tensors, src / "model.safetensors")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[Path, Path], None] | None
    needles: tuple[str, ...]
    args: tuple[str, ...] = ()
    dst: str = "tmp/dst"  # "src", "src/inside", "tmp" (SRC's parent)
    draft: bool = False
    kept_partial: bool = False  # fails after items were saved: DST.partial stays, resumable, and the line says so


CASES = [
    # destinations that would delete or overwrite what convert did not write
    Case("dst-is-src", None, ("is SRC",), ("--overwrite",), dst="src"),
    Case("dst-inside-src", None, ("inside SRC",), dst="src/inside"),
    Case("dst-contains-src", None, ("contains SRC",), ("--overwrite",), dst="tmp"),
    Case("dst-is-a-file-overwrite", dst_is_a_file, ("not a jaxspec checkpoint",), ("--overwrite",)),
    Case("dst-user-dir-overwrite", dst_is_a_user_directory, ("not a jaxspec checkpoint",), ("--overwrite",)),
    Case("partial-not-ours-restart", partial_not_ours, ("not a conversion's work directory",), ("--restart",)),
    # paths leaving SRC
    Case("tokenizer-symlink-out", tokenizer_symlink, ("tiktoken.model", "outside")),
    Case("index-path-traversal", index_traversal, ("../outside.safetensors", "outside")),
    Case("shard-symlink-out", shard_symlink, ("elsewhere.safetensors", "outside")),
    Case("index-shard-is-directory", index_shard_is_directory, ("subdir", "not a regular file")),
    Case("weight-map-list", weight_map(lambda m: list(m)), ("weight_map",)),
    Case("weight-map-int-value", weight_map(lambda m: {**m, next(iter(m)): 7}), ("maps to 7",)),
    # safetensors headers
    Case("offsets-negative", edit_header(negative_offsets), ("invalid data_offsets",)),
    Case("offsets-overlap", edit_header(overlapping_offsets), ("overlaps",)),
    Case("offsets-bytes-vs-shape", edit_header(wrong_byte_count), ("bytes, shape",)),
    Case("offsets-missing", edit_header(lambda h: h[first_two(h)[0]].pop("data_offsets")), ("header entry must be",)),
    Case("entry-is-string", edit_header(lambda h: h.__setitem__(first_two(h)[0], "oops")), ("header entry must be",)),
    Case("entry-is-list", edit_header(lambda h: h.__setitem__(first_two(h)[0], [1, 2])), ("header entry must be",)),
    Case("dtype-unknown", edit_header(lambda h: h[first_two(h)[0]].__setitem__("dtype", "F7")), ("unsupported dtype",)),
    Case("header-not-object", raw_header("[1, 2, 3]"), ("not an object",)),
    Case("header-nested-too-deep", raw_header("[" * 200_000), ("nested too deeply",)),
    Case("header-length-huge", huge_header_length, ("truncated safetensors file",)),
    Case("header-duplicate-key", duplicate_key, ("duplicate key",)),
    Case("trailing-bytes", trailing_bytes, ("after the last tensor",)),
    # config.json
    Case("src-is-a-file", src_is_file, ("not a directory",)),
    Case("config-json-list", config_text("[1, 2]"), ("config.json", "JSON object")),
    Case("config-json-nested-too-deep", config_text("[" * 200_000), ("config.json", "nested too deeply")),
    Case("config-layers-null", config(num_hidden_layers=None), ("'num_hidden_layers'",)),
    Case("config-hidden-size-string", config(hidden_size="sixty-four"), ("'hidden_size'",)),
    Case("config-text-config-string", config(text_config="oops"), ("'text_config'",)),
    Case("config-quantization-string", config(quantization_config="fp8"), ("'quantization_config'",)),
    Case("config-model-type-gpt2", config(model_type="gpt2"), ("model_type='gpt2'",)),
    # weights
    Case("nan-weight", nan_in("model.layers.1.self_attn.kv_a_layernorm.weight"),
         ("model.layers.1.self_attn.kv_a_layernorm.weight", "NaN / Inf", "--allow-nonfinite", "dst.partial is kept"),
         kept_partial=True),
    # flags
    Case("check-samples-negative", None, ("--check-samples",), ("--check-source", "--check-samples", "-5")),
    Case("check-samples-zero", None, ("--check-samples",), ("--check-source", "--check-samples", "0")),
    # drafters
    Case("draft-aux-ids-string", draft_config(eagle_aux_hidden_state_layer_ids="abc"),
         ("eagle_aux_hidden_state_layer_ids",), draft=True),
    Case("draft-d2t-out-of-range", draft_d2t_out_of_range, ("'d2t'",), draft=True),
]


def tree_digest(path: Path) -> dict:
    """Every file under `path` (symlinks as their target name) -> digest: what must survive a refused run."""
    out = {}
    for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if p.is_symlink():
            out[str(p)] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_case(case: Case, base: Path, tmp: Path, capsys) -> tuple[int, list[str], Path, dict, dict]:
    src = tmp / "src"
    shutil.copytree(base, src)
    if case.mutate is not None:
        case.mutate(src, tmp)
    dst = {"tmp/dst": tmp / "dst", "src": src, "src/inside": src / "inside", "tmp": tmp}[case.dst]
    before = {**tree_digest(src), **tree_digest(tmp / "dst")}
    capsys.readouterr()
    rc = main([str(src), str(dst), "--no-progress", *case.args])
    err = capsys.readouterr().err.strip().splitlines()
    after = {**tree_digest(src), **tree_digest(tmp / "dst")}
    return rc, err, dst, before, after


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_ends_in_one_error_line(case, base_src, base_draft, tmp_path, capsys):
    rc, err, dst, before, after = run_case(case, base_draft if case.draft else base_src, tmp_path, capsys)
    assert rc == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("convert: error: "), err
    for needle in case.needles:
        assert needle in err[0], (needle, err[0])
    assert before == after  # nothing of SRC or of a pre-existing DST was deleted or changed
    assert not (tmp_path / "dst" / "CONVERSION_COMPLETE").exists()
    assert (tmp_path / "dst.partial").exists() == (case.kept_partial or case.id == "partial-not-ours-restart")
    assert not (tmp_path / "dst.lock").exists()
    assert not any("secret" in p.name or p.name == "outside.safetensors" for p in (tmp_path / "dst").glob("*"))


def test_nonfinite_weights_convert_when_allowed(base_src, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(base_src, src)
    nan_in("model.layers.1.self_attn.kv_a_layernorm.weight")(src, tmp_path)
    assert main([str(src), str(tmp_path / "dst"), "--no-progress", "--allow-nonfinite"]) == 0
    assert (tmp_path / "dst" / "CONVERSION_COMPLETE").exists()


def test_a_destinations_aside_place_leading_into_src_is_refused(tmp_path):
    """--overwrite moves the old checkpoint to DST.replaced and removes it there: a DST.replaced that resolves into
    SRC is refused like a DST.partial or DST.lock would be."""
    src = tmp_path / "src"
    (src / "inside").mkdir(parents=True)
    (tmp_path / "dst.replaced").symlink_to(src / "inside")
    with pytest.raises(CheckpointError, match="dst.replaced: is inside SRC"):
        check_destination(src, tmp_path / "dst")


def test_check_source_names_metadata_without_a_kind(base_src, tmp_path, capsys):
    """jaxspec_checkpoint.json is not in its own manifest, so the digests pass whatever it says; a `kind` that is
    missing or unknown ends in one line naming the file (it was a KeyError traceback)."""
    dst = tmp_path / "dst"
    assert main([str(base_src), str(dst), "--no-progress"]) == 0
    meta = json.loads((dst / "jaxspec_checkpoint.json").read_text())
    for kind in (None, "vision"):
        meta.pop("kind", None)
        if kind is not None:
            meta["kind"] = kind
        (dst / "jaxspec_checkpoint.json").write_text(json.dumps(meta))
        capsys.readouterr()
        rc = main([str(base_src), str(dst), "--no-progress", "--check-source"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, err
        assert err[-1].startswith("convert: error: ") and "jaxspec_checkpoint.json" in err[-1] and "'kind'" in err[-1]
        assert not any("Traceback" in line for line in err)


def test_the_root_directory_as_destination(base_src, capsys):
    """DST.partial and DST.lock are named after DST, and `/` has no name: one line (it was a ValueError traceback)."""
    capsys.readouterr()
    rc = main([str(base_src), "/", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("convert: error: /: "), err
    assert "Traceback" not in "\n".join(err)


def test_overwrite_refuses_a_user_directory_where_the_old_checkpoint_goes(base_src, tmp_path, capsys):
    """--overwrite moves the old checkpoint to DST.replaced before renaming the new one into place. A DST.replaced
    that is not a jaxspec checkpoint is refused before converting: the rename failed only at the very end, naming
    DST, and left a finished DST.partial that no rerun could resume (only --restart, discarding it)."""
    dst = tmp_path / "dst"
    assert main([str(base_src), str(dst), "--no-progress"]) == 0
    (tmp_path / "dst.replaced").mkdir()
    (tmp_path / "dst.replaced" / "notes.txt").write_text("mine\n")
    before = tree_digest(tmp_path)
    capsys.readouterr()
    rc = main([str(base_src), str(dst), "--no-progress", "--overwrite"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("convert: error: "), err
    assert "dst.replaced" in err[0] and "not a jaxspec checkpoint" in err[0], err
    assert tree_digest(tmp_path) == before  # the old checkpoint, the user's directory, and no dst.partial
