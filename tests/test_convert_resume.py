"""A conversion killed midway (SIGKILL) leaves only DST.partial, which nothing loads; rerunning resumes it
and the result equals an uninterrupted conversion bit for bit."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convert.__main__ import main
from convert.checkpoint import COMPLETE_MARKER, load_item_numpy, load_target, partial_dir
from convert.safetensors_reader import CheckpointError
from convert.safetensors_reader import CheckpointReader
from convert.stream import ConvertOptions, convert_checkpoint
from convert.stream import source_fingerprint as _fingerprint
from tests import convert_fixtures as fx
from tests.convert_fixtures import REPO

ITEMS = ["embed", "layer_000", "layer_001", "layer_002", "layer_003", "head"]


@pytest.fixture(scope="module")
def int4_src(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    src = root / "src"
    src.mkdir()
    fx.int4_checkpoint(src, root / "scratch", num_hidden_layers=4)
    return src


def run_cli(src, dst, *flags, interrupt=()):
    """The convert CLI; `interrupt` ("--kill-after", "N") runs it through tests.convert_interrupted."""
    cmd = ["-m", "tests.convert_interrupted", *interrupt, "--"] if interrupt else ["-m", "convert"]
    return subprocess.run([sys.executable, *cmd, str(src), str(dst), "--no-progress", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=180)


def source_fingerprint(src):
    return _fingerprint(src, CheckpointReader(src))


def leaves_by_path(tree):
    import jax

    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_killed_run_resumes_to_the_uninterrupted_result(int4_src, tmp_path):
    reference = convert_checkpoint(int4_src, tmp_path / "reference", ConvertOptions(progress=False), lambda m: None)

    dst = tmp_path / "dst"
    killed = run_cli(int4_src, dst, interrupt=("--kill-after", "2"))
    assert killed.returncode == -signal.SIGKILL
    work = partial_dir(dst)
    assert not dst.exists() and work.is_dir()
    assert sorted(p.name for p in (work / "weights").glob("*.json")) == ["embed.json", "layer_000.json"]
    with pytest.raises(CheckpointError, match=f"{COMPLETE_MARKER} is missing"):
        load_target(work)
    # what a kill during the next item's save leaves: an item directory without its schema, an orbax temp dir
    shutil.copytree(work / "weights" / "layer_000", work / "weights" / "layer_001")
    (work / "weights" / "layer_002.orbax-checkpoint-tmp-123").mkdir()

    resumed = run_cli(int4_src, dst)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr and "2 of 6 items already converted" in resumed.stderr
    assert (dst / COMPLETE_MARKER).exists() and not work.exists()
    assert sorted(os.listdir(dst / "weights")) == sorted(os.listdir(reference / "weights"))

    for item in ITEMS:
        got, want = leaves_by_path(load_item_numpy(dst, item)), leaves_by_path(load_item_numpy(reference, item))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (item, k)
            assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), (item, k)
        # the schema equal but for the digests of the item's files (orbax writes a timestamp and random file names)
        schema = lambda d: {k: v for k, v in json.loads((d / "weights" / f"{item}.json").read_text()).items()  # noqa: E731
                            if k != "files"}
        assert schema(dst) == schema(reference)
    meta = lambda d: {k: v for k, v in json.loads((d / "jaxspec_checkpoint.json").read_text()).items()  # noqa: E731
                      if k != "manifest"}
    assert meta(dst) == meta(reference)


def test_overwrite_stopped_between_its_renames_is_finished_by_a_rerun(int4_src, tmp_path, monkeypatch, capsys):
    """--overwrite moves the old checkpoint to DST.replaced, then renames DST.partial to DST. A run stopped between
    the two leaves both whole and no DST; the same command again puts the new checkpoint in place and drops the
    old one (the partial's options stay until its rename, so the rerun can tell it is the same conversion)."""
    dst = tmp_path / "dst"
    convert_checkpoint(int4_src, dst, ConvertOptions(progress=False, dtype="bfloat16"), lambda m: None)
    real_replace = os.replace

    def replace_stopping_before_the_second(a, b):
        if Path(a) == partial_dir(dst):
            raise KeyboardInterrupt  # where a kill would land
        return real_replace(a, b)

    monkeypatch.setattr("convert.checkpoint.os.replace", replace_stopping_before_the_second)
    assert main([str(int4_src), str(dst), "--no-progress", "--dtype", "float32", "--overwrite"]) != 0
    monkeypatch.setattr("convert.checkpoint.os.replace", real_replace)
    replaced = dst.with_name(dst.name + ".replaced")
    assert not dst.exists()
    assert (partial_dir(dst) / COMPLETE_MARKER).is_file() and (replaced / COMPLETE_MARKER).is_file()
    capsys.readouterr()

    assert main([str(int4_src), str(dst), "--no-progress", "--dtype", "float32", "--overwrite"]) == 0
    assert "6 of 6 items already converted" in capsys.readouterr().err
    assert json.loads((dst / "jaxspec_checkpoint.json").read_text())["dtype"] == "float32"
    assert not replaced.exists() and not partial_dir(dst).exists() and not (dst / "convert_options.json").exists()
    assert main([str(int4_src), str(dst), "--check"]) == 0


def test_resume_refuses_other_options_unless_restarted(int4_src, tmp_path, capsys):
    dst = tmp_path / "dst"
    convert_checkpoint(int4_src, dst, ConvertOptions(progress=False), lambda m: None)
    os.replace(dst, partial_dir(dst))  # a bf16 conversion's unfinished work dir (the marker does not matter)
    (partial_dir(dst) / COMPLETE_MARKER).unlink()
    (partial_dir(dst) / "weights" / "head.json").unlink()
    (partial_dir(dst) / "convert_options.json").write_text(json.dumps(
        {"kind": "target", "dtype": "bfloat16", "experts": "int4", "source": source_fingerprint(int4_src)}))
    assert main([str(int4_src), str(dst), "--no-progress", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unfinished conversion with other options" in err[0] and "--restart" in err[0]
    assert not dst.exists()
    assert main([str(int4_src), str(dst), "--no-progress", "--dtype", "float32", "--restart"]) == 0
    assert json.loads((dst / "jaxspec_checkpoint.json").read_text())["dtype"] == "float32"


def test_check_flags_a_corrupted_conversion(int4_src, tmp_path, capsys):
    """--check on a complete DST only checks; after overwriting one converted item its digests no longer match,
    and the source comparison (the second level) names the tensor that differs."""
    dst = convert_checkpoint(int4_src, tmp_path / "dst", ConvertOptions(progress=False), lambda m: None)
    assert main([str(int4_src), str(dst), "--check-source", "--check-samples", "1000"]) == 0
    assert "match the source" in capsys.readouterr().err

    import orbax.checkpoint as ocp

    from convert import tree_schema
    from convert.check import check_target

    layer = load_item_numpy(dst, "layer_001")
    flat = tree_schema.flat_arrays(layer)
    flat["attn.kv_a_norm"] = flat["attn.kv_a_norm"] + np.asarray(1, flat["attn.kv_a_norm"].dtype)
    shutil.rmtree(dst / "weights" / "layer_001")
    with ocp.StandardCheckpointer() as ck:
        ck.save(dst / "weights" / "layer_001", flat)
    assert main([str(int4_src), str(dst), "--check"]) == 2
    err = capsys.readouterr().err
    assert "check: BAD " in err and "weights/layer_001/" in err and "--check found" in err
    log = []
    raw = json.loads((int4_src / "config.json").read_text())
    assert check_target(int4_src, dst, raw, 1000, 0, log.append) == 1
    assert any("MISMATCH model.layers.1.self_attn.kv_a_layernorm.weight (item layer_001)" in line for line in log)
