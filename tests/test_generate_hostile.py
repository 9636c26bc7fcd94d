"""`python -m jaxspec.generate` given what a hostile user or a damaged checkpoint gives it: stdin closed or not UTF-8,
a reader that leaves the pipe, broken chat templates, deleted or tampered checkpoint files, out-of-range flags and a
drafter that repeats an aux layer. Each ends in one line `error: ...` and exit status 2 (the closed pipe: quietly, 0).

Everything that fails before compiling runs in this process; stdin and the pipe need a real process."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.checkpoint import save_draft, save_target
from jaxspec.generate import main as generate_main
from model.init import init_draft_weights
from tests.kimi_tokenizer_fixture import write_kimi_tokenizer
from tests.numpy_pair import numpy_tiny_pair

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate_hostile")
    vocab = write_kimi_tokenizer(root / "tok")
    cfg, w = numpy_tiny_pair(seed=4, vocab=vocab)
    save_target(root / "model", w.target, cfg.target, tokenizer_dir=root / "tok")
    repeats = dataclasses.replace(cfg.draft, aux_layer_ids=(0, 1, 1))  # refused on its config: zeros will do
    shapes = jax.eval_shape(lambda key: init_draft_weights(repeats, key, jnp.float32), jax.random.key(1))
    save_draft(root / "draft_repeats", jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes), repeats)
    return root


def cli(*args, stdin=None, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "jaxspec.generate", *map(str, args)], capture_output=True,
                          input=stdin, env=env, cwd=REPO, timeout=240, **kw)


def one_error_line(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err, err
    assert lines and lines[-1].startswith("error: "), err
    assert sum(line.startswith("error: ") for line in lines) == 1, err
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])


def run_in_process(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = generate_main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_stdin_closed_falls_back_to_the_default_prompt(tmp_path):
    """`<&-`: no stdin at all. The prompt falls back to the default; the run then fails on the missing model."""
    r = subprocess.run(["bash", "-c", f'exec "{sys.executable}" -m jaxspec.generate --model {tmp_path}/none <&-'],
                       capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=240)
    one_error_line(r.returncode, r.stderr, "no such checkpoint")


def test_stdin_that_is_not_utf8(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def f():\n\xff\xfe\n"), encoding="utf-8"))
    code, err = run_in_process(capsys, "--model", tmp_path / "none")
    one_error_line(code, err, "stdin", "not valid UTF-8")


def test_output_into_a_closed_pipe_ends_quietly(ckpt, capfd):
    """`... | head -c 20`: the reader is gone before the first token; no BrokenPipeError, no traceback, status 0.
    In this process (a subprocess would pay for importing jax again): stdout is a pipe whose reader is closed."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    saved = sys.stdout
    sys.stdout = os.fdopen(write_end, "w")
    try:
        code = generate_main(["--model", str(ckpt / "model"), "--prompt", "the", "--speculative-num-steps", "0",
                              "--max-new-tokens", "2", "--max-context", "32"])
    finally:
        pipe, sys.stdout = sys.stdout, saved
        pipe.close()  # its fd now points at /dev/null: closing flushes nowhere, quietly
    err = capfd.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "error" not in err, err


TEMPLATES = [
    ("chat_template.jinja", "{% for m in messages %}{{ m['content'] }", "syntax error"),
    ("chat_template.jinja", "{% for i in range(10**9) %}{% endfor %}", "chat template failed"),
    ("chat_template.jinja", "{{ ''.__class__.__mro__ }}", "chat template failed"),
    ("chat_template.json", json.dumps({"chat_template": 5}), "must be a string"),
    ("chat_template.json", json.dumps(["{{ x }}"]), "must be a JSON object"),
]


@pytest.mark.parametrize("name, text, needle", TEMPLATES, ids=["syntax", "range", "sandbox", "not-a-string", "list"])
def test_broken_chat_template(ckpt, tmp_path, capsys, name, text, needle):
    model = tmp_path / "model"
    shutil.copytree(ckpt / "model", model)
    (model / name).write_text(text)  # beside the checkpoint, as a source's own template would be
    code, err = run_in_process(capsys, "--model", model, "--prompt", "hi", "--chat", "--speculative-num-steps", "0")
    one_error_line(code, err, name, needle)


@pytest.mark.parametrize("victim", ["jaxspec_checkpoint.json", "weights/layer_002.json", "weights/layer_001/manifest.ocdbt",
                                    "data file"])
def test_deleted_checkpoint_file(ckpt, tmp_path, capsys, victim):
    model = tmp_path / "model"
    shutil.copytree(ckpt / "model", model)
    data = max((p for p in (model / "weights" / "layer_000").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    path = data if victim == "data file" else model / victim
    path.unlink()
    code, err = run_in_process(capsys, "--model", model, "--prompt", "hi", "--speculative-num-steps", "0")
    one_error_line(code, err, path.name)


def test_serve_names_a_deleted_checkpoint_file(ckpt, tmp_path, capsys):
    """The server loads with the same readers: an unreadable file is the same one line, before any port is bound."""
    from jaxspec.serve import main as serve_main

    model = tmp_path / "model"
    shutil.copytree(ckpt / "model", model)
    data = max((p for p in (model / "weights" / "layer_000").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.unlink()
    capsys.readouterr()
    code = serve_main(["--model", str(model), "--speculative-num-steps", "0", "--port", "1"])
    one_error_line(code, capsys.readouterr().err, data.name)


def test_tampered_weights_are_caught_with_verify_weights(ckpt, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(ckpt / "model", model)
    data = max((p for p in (model / "weights" / "layer_001").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    code, err = run_in_process(capsys, "--model", model, "--prompt", "hi", "--speculative-num-steps", "0",
                               "--verify-weights")
    one_error_line(code, err, data.name, "SHA-256 differs")


@pytest.mark.parametrize("flag", ["--seed", "--top-k"])
def test_flag_beyond_64_bits(capsys, flag):
    code, err = run_in_process(capsys, flag, str(2**63), "--prompt", "x")
    one_error_line(code, err, flag)


def test_drafter_repeating_an_aux_layer_is_refused_at_the_fit_check(ckpt, capsys):
    code, err = run_in_process(capsys, "--model", ckpt / "model", "--draft", ckpt / "draft_repeats", "--prompt", "x")
    one_error_line(code, err, "[0, 1, 1]", "repeat a layer")


def test_batch_file_splits_at_newlines_only(tmp_path):
    """One prompt per line: a form feed (Python sources hold them between sections), a vertical tab or U+2028 inside
    a line stays in its prompt (str.splitlines() would split there too); CRLF files read as LF."""
    from jaxspec.generate import _read_prompts, build_parser

    f = tmp_path / "prompts.txt"
    f.write_bytes("def f():\f    return\r\n\r\nx = 1\v2 \u2028 3\n".encode())
    prompts, batch = _read_prompts(build_parser().parse_args(["--batch-file", str(f)]))
    assert batch and prompts == ["def f():\f    return", "x = 1\v2 \u2028 3"]


def test_json_nested_past_the_decoders_depth_is_one_error_line(ckpt, tmp_path, capsys):
    """A tools file, template kwargs, a cost table or a checkpoint's generation_config.json nested deeper than
    json.loads recurses: one error line naming it, not a RecursionError traceback."""
    deep = "[" * 200_000
    tools = tmp_path / "tools.json"
    tools.write_text(deep)
    code, err = run_in_process(capsys, "--chat", "--tools", tools, "--prompt", "x")
    one_error_line(code, err, "--tools", "nested too deeply")
    code, err = run_in_process(capsys, "--chat", "--chat-template-kwargs", deep, "--prompt", "x")
    one_error_line(code, err, "--chat-template-kwargs", "nested too deeply")
    code, err = run_in_process(capsys, "--speculative-adaptive-costs", deep, "--prompt", "x")
    one_error_line(code, err, "--speculative-adaptive-costs", "nested too deeply")
    model = tmp_path / "model"
    shutil.copytree(ckpt / "model", model)
    (model / "generation_config.json").write_text(deep)
    code, err = run_in_process(capsys, "--model", model, "--speculative-num-steps", 0, "--prompt", "x")
    one_error_line(code, err, "generation_config.json", "nested too deeply")
