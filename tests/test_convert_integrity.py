"""A conversion's output cannot silently lose or mix data: one conversion per DST at a time (two real processes),
a resume refuses a source edited since the kill, and the manifest's digests catch tampered weights in `--check` and
in loading."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from convert.__main__ import main
from convert.checkpoint import COMPLETE_MARKER, METADATA_FILE, load_target, partial_dir
from convert.errors import CheckpointError
from tests import convert_fixtures as fx
from tests.convert_fixtures import REPO


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A bf16 3-layer checkpoint, sharded so that layers sit in different files."""
    root = tmp_path_factory.mktemp("integrity")
    model = fx.make_hf_model(6, **fx.CONVERT_TINY)
    fx.round_model_to_bf16_(model)
    model.to(torch.bfloat16).save_pretrained(root, safe_serialization=True, max_shard_size="150KB")
    fx.write_tokenizer_files(root)
    return root


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("integrity_out") / "dst"
    assert main([str(src), str(dst), "--no-progress"]) == 0
    return dst


def run_cli(src, dst, *flags, interrupt=(), **kw):
    """The convert CLI; `interrupt` ("--stop-after", "N") runs it through tests.convert_interrupted."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = ["-m", "tests.convert_interrupted", *interrupt, "--"] if interrupt else ["-m", "convert"]
    return subprocess.Popen([sys.executable, *cmd, str(src), str(dst), "--no-progress", *flags],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def finish(p, timeout=180):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, err


def largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_byte(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_second_conversion_into_the_same_destination_is_refused(src, tmp_path):
    """Process A stops itself (SIGSTOP) after its first item, lock held; process B into the same DST exits 2
    naming A, and leaves A's DST.partial alone; A then finishes a complete, loadable checkpoint."""
    dst = tmp_path / "dst"
    a = run_cli(src, dst, interrupt=("--stop-after", "1"))
    try:
        _, status = os.waitpid(a.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        work = partial_dir(dst)
        before = sorted(p.name for p in (work / "weights").iterdir())
        b = run_cli(src, dst)
        rc, err = finish(b)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, err
        assert lines[0].startswith("convert: error: ") and "dst.lock" in lines[0] and f"pid {a.pid}" in lines[0]
        assert sorted(p.name for p in (work / "weights").iterdir()) == before
        assert not dst.exists()
    finally:
        os.kill(a.pid, signal.SIGCONT)
    rc, err = finish(a)
    assert rc == 0, err
    assert (dst / COMPLETE_MARKER).exists() and not partial_dir(dst).exists() and not (tmp_path / "dst.lock").exists()
    cfg, w = load_target(dst, verify="full")
    assert len(w.layers) == cfg.num_hidden_layers == 3


def test_resume_refuses_a_source_edited_since_the_kill(src, tmp_path, capsys):
    """A shard edited in place (same size) between a kill and the resume: the resume names the shard and keeps
    DST.partial; --restart converts the edited source afresh."""
    own = tmp_path / "src"
    shutil.copytree(src, own)
    dst = tmp_path / "dst"
    rc, err = finish(run_cli(own, dst, interrupt=("--kill-after", "1")))
    assert rc == -signal.SIGKILL, err
    idx = json.loads((own / "model.safetensors.index.json").read_text())
    shard = own / idx["weight_map"]["model.layers.2.mlp.gate.weight"]
    size = shard.stat().st_size
    flip_byte(shard, at=size - 3)  # a data byte of a layer not converted yet
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert shard.stat().st_size == size
    capsys.readouterr()
    rc = main([str(own), str(dst), "--no-progress"])  # the resume, in this process
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "source changed" in lines[0] and shard.name in lines[0] and "--restart" in lines[0]
    assert partial_dir(dst).is_dir() and not dst.exists()
    assert main([str(own), str(dst), "--no-progress", "--restart"]) == 0


def test_check_verifies_every_digest(src, converted, tmp_path, capsys):
    dst = tmp_path / "dst"
    shutil.copytree(converted, dst)
    capsys.readouterr()
    assert main([str(src), str(dst), "--check"]) == 0
    meta = json.loads((dst / METADATA_FILE).read_text())
    assert "check: %d of %d files match" % (len(meta["manifest"]), len(meta["manifest"])) in capsys.readouterr().err
    victim = largest_file(dst / "weights" / "layer_002")
    flip_byte(victim)
    assert main([str(src), str(dst), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"check: BAD {victim}: SHA-256 differs" in err
    assert err.strip().splitlines()[-1].startswith("convert: error: ") and "--check found 1 problem" in err


def test_check_names_files_the_engine_reads_that_the_manifest_does_not_list(src, converted, tmp_path, capsys):
    """A template, tokenizer or generation file put beside the weights after the conversion (the names the converter
    copies, which the engine reads there) has no digest to vouch for it: --check names it; other files do not
    count."""
    dst = tmp_path / "dst"
    shutil.copytree(converted, dst)
    (dst / "NOTES.txt").write_text("mine\n")
    capsys.readouterr()
    assert main([str(src), str(dst), "--check"]) == 0
    added = dst / "tool_use.jinja"  # another template (`*.jinja`), as some Hugging Face repos carry
    assert not added.exists()
    added.write_text("{{ messages[0]['content'] }}")
    assert main([str(src), str(dst), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"check: BAD {added}: a tokenizer, template or generation file" in err and "not list" in err
    assert "--check found 1 problem" in err


def test_loading_verifies_sizes_always_and_digests_on_request(converted, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(converted, dst)
    victim = largest_file(dst / "weights" / "layer_001")
    flip_byte(victim)
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        load_target(dst, verify="full")
    victim.write_bytes(victim.read_bytes()[:-1])  # one byte shorter: the default, size-only check sees it
    with pytest.raises(CheckpointError, match=f"{victim}: .* bytes, the manifest says"):
        load_target(dst)


@pytest.mark.parametrize("victim", ["jaxspec_checkpoint.json", "weights/layer_002.json", "weights/layer_001/manifest.ocdbt",
                                    "data file", "config.json"])
def test_a_deleted_file_is_named(converted, tmp_path, victim):
    dst = tmp_path / "dst"
    shutil.copytree(converted, dst)
    path = largest_file(dst / "weights" / "layer_000") if victim == "data file" else dst / victim
    path.unlink()
    with pytest.raises(CheckpointError, match=str(path.name if victim == "data file" else victim).replace(".", r"\.")):
        load_target(dst)
