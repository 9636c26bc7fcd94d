"""`python -m jaxspec.train_target` / `jaxspec.train_draft` given bad input: flags out of range, a corpus that
holds nothing to train on, a tokenizer or target that is not one, a tokenizer of another vocabulary than the
target's, an output path that already holds something. Each ends in one line `error: ...` naming what was
refused and exit status 2, before any training; an interrupted run leaves nothing that looks finished.

Everything here fails before compiling anything (the interrupted run stops at its first step)."""

from __future__ import annotations

import json

import pytest

from jaxspec import train_draft, train_target
from jaxspec.training import artifacts
from jaxspec.training.artifacts import save_model_dir
from jaxspec.training.corpus import read_sources
from jaxspec.training.target_config import mini_k25_config
from jaxspec.training.target_init import init_target_for_training
from jaxspec.training.tokenizer import train_tokenizer
from model.config import text_config_from_dict

SMALL = ["--preset", "smoke", "--max-files", "6", "--held-out-percent", "25", "--val-percent", "20",
         "--seq-len", "64", "--batch", "8", "--steps", "2"]
DRAFT_SMALL = [*SMALL, "--prompt-len", "16", "--rollouts", "8", "--rollout-batch", "8", "--eval-prompts", "8"]


def one_error_line(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def run(capsys, tool, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = tool.cli([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A smoke-sized target directory (untrained) and its tokenizer, as train_target writes them."""
    root = tmp_path_factory.mktemp("train_inputs")
    tok = train_tokenizer(read_sources(max_files=6), 300)
    tok.save(str(root / "tokenizer.json"))
    config = mini_k25_config(tok.get_vocab_size(), "smoke")
    save_model_dir(root / "target", config, init_target_for_training(text_config_from_dict(config), 0))
    other = train_tokenizer(read_sources(max_files=6), 400)
    other.save(str(root / "other_tokenizer.json"))
    return root


def test_interrupted_save_leaves_no_config(tmp_path, monkeypatch, pair):
    """config.json marks a finished model directory (the loaders and train_default_pair.sh look for it): it is
    written after the weights, so a save cut short cannot be taken for a model."""
    cfg, w = artifacts.load_target_dir(pair / "target")

    def cut_short(directory, name, tree, **kw):
        (directory / f"{name}-00000.npz").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts, "save_flat", cut_short)
    with pytest.raises(KeyboardInterrupt):
        save_model_dir(tmp_path / "target", json.loads((pair / "target" / "config.json").read_text()), w)
    assert not (tmp_path / "target" / "config.json").exists()
