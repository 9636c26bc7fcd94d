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


TARGET_FLAGS = [
    ("--steps", "0"), ("--steps", "-3"), ("--batch", "0"), ("--seq-len", "1"), ("--max-files", "0"),
    ("--eval-every", "0"), ("--log-every", "0"), ("--eval-windows", "0"), ("--final-eval-windows", "-1"),
    ("--warmup", "-1"), ("--lr", "nan"), ("--lr", "-1"), ("--weight-decay", "inf"), ("--bias-gamma", "nan"),
    ("--held-out-percent", "101"), ("--held-out-percent", "-1"), ("--val-percent", "nan"), ("--vocab-size", "0"),
]


@pytest.mark.parametrize("flag,value", TARGET_FLAGS, ids=[f"{f}={v}" for f, v in TARGET_FLAGS])
def test_train_target_flag_out_of_range(tmp_path, capsys, flag, value):
    args = [a for a in SMALL if a != "--steps" and a != "2"] if flag == "--steps" else SMALL
    code, err = run(capsys, train_target, "--out", tmp_path / "out", *args, flag, value)
    one_error_line(code, err, flag)
    assert not (tmp_path / "out").exists()


def test_train_target_time_budget_out_of_range(tmp_path, capsys):
    code, err = run(capsys, train_target, "--out", tmp_path / "out", "--time-budget", "0")
    one_error_line(code, err, "--time-budget")


def test_train_target_splits_leave_no_training_files(tmp_path, capsys):
    code, err = run(capsys, train_target, "--out", tmp_path / "out", *SMALL, "--held-out-percent", "60",
                    "--val-percent", "40")
    one_error_line(code, err, "--held-out-percent", "--val-percent")


DRAFT_FLAGS = [
    ("--eval-prompts", "0"), ("--ckpt-every", "0"), ("--eval-every", "0"), ("--ttt-steps", "0"),
    ("--eval-depth", "0"), ("--rollouts", "0"), ("--rollout-batch", "0"), ("--generated-fraction", "1.5"),
    ("--generated-fraction", "nan"), ("--draft-vocab-size", "0"), ("--draft-vocab-size", "-5"),
    ("--prompt-len", "64"), ("--prompt-len", "0"), ("--reserve", "-1"), ("--finish-by", "nan"),
]


@pytest.mark.parametrize("flag,value", DRAFT_FLAGS, ids=[f"{f}={v}" for f, v in DRAFT_FLAGS])
def test_train_draft_flag_out_of_range(pair, tmp_path, capsys, flag, value):
    args = [a for a in DRAFT_SMALL if a != "--steps" and a != "2"] if flag == "--finish-by" else DRAFT_SMALL
    code, err = run(capsys, train_draft, "--target", pair / "target", "--tokenizer", pair / "tokenizer.json",
                    "--out", tmp_path / "draft", *args, flag, value)
    one_error_line(code, err, flag)


def test_corpus_root_with_nothing_to_train_on(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.py").write_bytes(b"x = '\xe9t\xe9'\n")
    (tmp_path / "a_file.py").write_text("x = 1\n")
    for root in (tmp_path / "missing", tmp_path / "empty", tmp_path / "latin1", tmp_path / "a_file.py"):
        code, err = run(capsys, train_target, "--out", tmp_path / "out", *SMALL, "--corpus-root", root)
        one_error_line(code, err, "--corpus-root", str(root))
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_corpus_too_small_for_a_window(tmp_path, capsys):
    """One short file: no training window of --seq-len tokens (was a numpy ValueError from random_windows)."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "one.py").write_text("x = 1\n")
    code, err = run(capsys, train_target, "--out", tmp_path / "out", *SMALL, "--held-out-percent", "0",
                    "--val-percent", "0", "--corpus-root", tmp_path / "corpus")
    one_error_line(code, err, "--seq-len")


def test_draft_corpus_without_a_prompt_long_enough(tmp_path, capsys, pair):
    """Held-out files all shorter than --prompt-len: no evaluation prompt (was a ValueError after the rollouts)."""
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"m{i}.py").write_text(f"x{i} = {i}\n")
    code, err = run(capsys, train_draft, "--target", pair / "target", "--tokenizer", pair / "tokenizer.json",
                    "--out", tmp_path / "draft", *DRAFT_SMALL, "--max-files", "40",
                    "--corpus-root", tmp_path / "corpus")
    one_error_line(code, err, "--prompt-len")


def test_tokenizer_that_is_not_one(tmp_path, capsys, pair):
    (tmp_path / "garbage.json").write_bytes(b"\x00\x01 not json")
    for tok in (tmp_path / "missing.json", tmp_path / "garbage.json", tmp_path):
        code, err = run(capsys, train_target, "--out", tmp_path / "out", *SMALL, "--tokenizer", tok)
        one_error_line(code, err, "--tokenizer", str(tok))
        code, err = run(capsys, train_draft, "--target", pair / "target", "--tokenizer", tok,
                        "--out", tmp_path / "draft", *DRAFT_SMALL)
        one_error_line(code, err, "--tokenizer", str(tok))


def test_target_that_is_not_a_train_target_output(tmp_path, capsys, pair):
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((pair / "target" / "config.json").read_text())
    (tmp_path / "a_file").write_text("x")
    for target in (tmp_path / "missing", pair, tmp_path / "no_weights", tmp_path / "a_file"):
        code, err = run(capsys, train_draft, "--target", target, "--tokenizer", pair / "tokenizer.json",
                        "--out", tmp_path / "draft", *DRAFT_SMALL)
        one_error_line(code, err, "--target", str(target))
        assert not (tmp_path / "draft").exists()


def test_draft_tokenizer_of_another_vocabulary(tmp_path, capsys, pair):
    """A tokenizer whose ids are not the target's: larger (was an IndexError) or not (trained a draft silently)."""
    code, err = run(capsys, train_draft, "--target", pair / "target", "--tokenizer", pair / "other_tokenizer.json",
                    "--out", tmp_path / "draft", *DRAFT_SMALL)
    one_error_line(code, err, "--tokenizer", "400", "300")


def test_output_that_already_holds_something(tmp_path, capsys, pair):
    """A user's non-empty directory or a file at --out is refused, untouched; an empty directory is fine."""
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "tokenizer.json").write_text("mine")
    (tmp_path / "a_file").write_text("mine")
    for out in (tmp_path / "user", tmp_path / "a_file"):
        code, err = run(capsys, train_target, "--out", out, *SMALL)
        one_error_line(code, err, "--out", str(out))
        code, err = run(capsys, train_draft, "--target", pair / "target", "--tokenizer", pair / "tokenizer.json",
                        "--out", out, *DRAFT_SMALL)
        one_error_line(code, err, "--out", str(out))
    assert (tmp_path / "user" / "tokenizer.json").read_text() == "mine" and (tmp_path / "a_file").read_text() == "mine"
    assert [p.name for p in (tmp_path / "user").iterdir()] == ["tokenizer.json"]


def test_interrupted_target_run_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    """Ctrl-C during training: no tokenizer.json without its target, and the same command can run again."""

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_target, "train_step", interrupted)
    code, err = run(capsys, train_target, "--out", tmp_path / "out", *SMALL, "--max-files", "24",
                    "--vocab-size", "300")
    assert code == 130 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


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


def test_resume_from_checkpoints_of_another_run(tmp_path):
    """--ckpt-dir of a run with other shapes (was an orbax ValueError traceback) or another draft vocabulary (same
    shapes: resumed silently, the trained lm_head rows then stood for other tokens) is refused, naming --ckpt-dir."""
    import numpy as np

    from jaxspec.cli_common import UsageError
    from jaxspec.training.orbax_resume import DraftCheckpoints

    import jax.numpy as jnp

    state = {"lm_head": jnp.ones((4, 2), jnp.float32)}
    ckpts = DraftCheckpoints(tmp_path / "ckpt", run_key={"draft_ids": [0, 1, 2, 3]})
    ckpts.save(2, state, {"train_step": [1, 2]}, 4)
    ckpts.close()
    same = DraftCheckpoints(tmp_path / "ckpt", run_key={"draft_ids": [0, 1, 2, 3]})
    step, got, curves, total = same.restore(state)
    assert (step, curves, total) == (2, {"train_step": [1, 2]}, 4)
    np.testing.assert_array_equal(np.asarray(got["lm_head"]), state["lm_head"])
    same.close()
    other_vocab = DraftCheckpoints(tmp_path / "ckpt", run_key={"draft_ids": [0, 1, 2, 5]})
    with pytest.raises(UsageError, match="--ckpt-dir.*draft vocabulary"):
        other_vocab.restore(state)
    other_vocab.close()
    other_shape = DraftCheckpoints(tmp_path / "ckpt", run_key={"draft_ids": [0, 1, 2, 3]})
    with pytest.raises(UsageError, match="--ckpt-dir"):
        other_shape.restore({"lm_head": jnp.ones((3, 2), jnp.float32)})
    other_shape.close()
