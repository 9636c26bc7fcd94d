"""`python -m jaxspec.generate`: outputs equal the library's, the JSON schema, the --baseline figures, errors.

Most cases call `jaxspec.generate.main` in this process: each subprocess pays a JAX import, a checkpoint load and the
compiled programs' load, where in-process runs share the library engine's compiled programs. Three runs still go
through `python -m`: the streamed run from stdin (stdout holds exactly the text), one flag error and one checkpoint
error (the real exit status and the whole of stderr)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.checkpoint import load_target, save_draft, save_target
from jaxspec import adaptive_costs
from jaxspec.engine import Engine
from jaxspec.defaults import default_adaptive_kind
from jaxspec.generate import JSON_SCHEMA
from jaxspec.generate import main as generate_main
from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.tokenizer import load_tokenizer
from model.init import init_draft_weights
from tests.kimi_tokenizer_fixture import write_kimi_tokenizer
from tests.numpy_pair import numpy_tiny_pair

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def the thing"
BATCH = ["def the thing is", "and", "return the answer and the thing in the end"]


def cli(*args, stdin=None, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(REPO))  # conftest's XLA_FLAGS: 8 CPU devices, the tests' compile options
    return subprocess.run([sys.executable, "-m", "jaxspec.generate", *map(str, args)], capture_output=True, text=True,
                          input=stdin, env=env, cwd=REPO, timeout=timeout)


def cli_in_process(capsys, *args):
    """(exit status, stderr) of `jaxspec.generate.main`: the code `python -m jaxspec.generate` exits with."""
    code, _, err = cli_json(capsys, *args)
    return code, err


def cli_json(capsys, *args):
    """(exit status, stdout, stderr) of `jaxspec.generate.main` in this process."""
    capsys.readouterr()
    code = generate_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    vocab = write_kimi_tokenizer(root / "tok")
    cfg, w = numpy_tiny_pair(seed=4, vocab=vocab, logit_scale=3.0)
    save_target(root / "model", w.target, cfg.target, tokenizer_dir=root / "tok")
    save_draft(root / "model" / "draft", w.draft, cfg.draft)
    # drafters that do not fit the target
    bad = {
        "hidden": dataclasses.replace(cfg.draft, hidden_size=48),
        "vocab": dataclasses.replace(cfg.draft, vocab_size=vocab + 8, draft_vocab_size=vocab + 8),
        "aux": dataclasses.replace(cfg.draft, aux_layer_ids=(0, 1, 9)),
    }
    for name, dcfg in bad.items():  # refused on their shapes: zeros of those shapes, nothing to compile
        shapes = jax.eval_shape(lambda key, dcfg=dcfg: init_draft_weights(dcfg, key, jnp.float32), jax.random.key(1))
        save_draft(root / f"bad_{name}", jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes), dcfg)
    return root


MAX_NEW = 16  # one value everywhere: the library engine compiles once


@pytest.fixture(scope="module")
def library(ckpt):
    """Greedy baseline tokens from the library itself (float32, the target alone), one prompt at a time: the
    programs `--speculative-num-steps 0` runs for one prompt, so those runs find them compiled."""
    cfg, tw = load_target(ckpt / "model", dtype=jnp.float32)
    tok = load_tokenizer(ckpt / "model")
    eng = Engine(SpecConfig(cfg, None, (tok.token_id("eos_token"),)), SpecWeights(tw, None), num_steps=0)
    return lambda prompt: eng.generate([tok.encode(prompt)], MAX_NEW).tokens[0]


def _check_schema(doc, schema):
    assert set(doc) == set(schema)
    for key, sub in schema.items():
        if isinstance(sub, dict) and doc[key] is not None:
            _check_schema(doc[key], sub)
        elif isinstance(sub, list):
            for item in doc[key]:
                _check_schema(item, sub[0])


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_cli_equals_library_baseline(ckpt, library, k, capsys):
    want = library(PROMPT)
    # no --dtype: float32 on a CPU, as the library engine runs
    # --moe-kernel grouped: off a Hopper GPU the plain routed experts run, so the tokens stay the library's
    # --no-speculative-adaptive: fixed K (on a CPU adaptive is the default: test_cpu_default_is_adaptive)
    moe = ["--moe-kernel", "grouped", "--no-speculative-adaptive"] if k else []
    code, out, err = cli_json(capsys, "--model", ckpt / "model", "--prompt", PROMPT, "--max-new-tokens", MAX_NEW,
                              "--speculative-num-steps", k, "--json", *moe)
    assert code == 0, err
    doc = json.loads(out)
    _check_schema(doc, JSON_SCHEMA)
    assert doc["dtype"] == "float32" and doc["moe_kernel"] == ("grouped" if k else "auto")
    res = doc["results"][0]
    assert res["tokens"] == want
    assert res["prompt_tokens"] == len(load_tokenizer(ckpt / "model").encode(PROMPT))
    assert doc["speculative_num_steps"] == k
    if k:
        assert len(res["accepted_per_cycle"]) == doc["timings"]["cycles"]
        assert sum(doc["acceptance"]["histogram"]) == doc["timings"]["cycles"]
        assert doc["acceptance"]["mean_acceptance_length"] >= 1.0


@pytest.mark.parametrize("kind", [None, "per_cycle"])
def test_adaptive_cli_equals_library_baseline_and_reports_its_choices(ckpt, library, kind, capsys):
    # K = 1: the smallest compiled set, plain decoding or one draft (each K in the set is a branch to compile);
    # no kind: the CPU's default
    costs = '{"0": 1.0, "1": 1.2}'
    chosen = ["--speculative-adaptive-kind", kind] if kind else []
    code, out, err = cli_json(capsys, "--model", ckpt / "model", "--prompt", PROMPT, "--max-new-tokens", MAX_NEW,
                              "--dtype", "float32", "--speculative-num-steps", 1, "--speculative-adaptive",
                              "--speculative-adaptive-costs", costs, "--json", *chosen)
    assert code == 0, err
    doc = json.loads(out)
    _check_schema(doc, JSON_SCHEMA)
    assert doc["results"][0]["tokens"] == library(PROMPT)
    ad = doc["adaptive"]
    assert ad["kind"] == (kind or default_adaptive_kind("cpu"))
    assert (ad["calls"] >= 1) if ad["kind"] == "per_call" else ad["calls"] is None
    assert ad["steps"] == [0, 1] and ad["cost_source"] == "given"
    assert ad["costs_ms"] == {"0": 1.0, "1": 1.2}
    assert len(ad["k_per_cycle"]) == doc["timings"]["cycles"] == sum(ad["k_histogram"].values())
    assert ad["expected_tokens_per_s"] > 0 and ad["achieved_tokens_per_s"] > 0
    drafted = sum(1 for k in ad["k_per_cycle"] if k > 0)
    assert sum(doc["acceptance"]["histogram"]) == drafted


def test_the_adaptive_kind_needs_adaptive_speculation(ckpt, capsys):
    code, _, err = cli_json(capsys, "--model", ckpt / "model", "--prompt", PROMPT, "--speculative-num-steps", 1,
                            "--no-speculative-adaptive", "--speculative-adaptive-kind", "per_call", "--json")
    assert code != 0 and "--speculative-adaptive-kind needs adaptive speculation" in err


def test_cpu_default_is_adaptive(ckpt, library, capsys):
    """No adaptive flag on a CPU: K is chosen between calls (from a cost table measured at start-up), up to the K
    asked for; --no-speculative-adaptive runs fixed K."""
    assert jax.default_backend() == "cpu"
    code, out, err = cli_json(capsys, "--model", ckpt / "model", "--prompt", PROMPT, "--max-new-tokens", MAX_NEW,
                              "--speculative-num-steps", 1, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["results"][0]["tokens"] == library(PROMPT)
    ad = doc["adaptive"]
    assert ad["steps"] == [0, 1] and ad["cost_source"] in ("measured", "cached")
    assert len(ad["k_per_cycle"]) == doc["timings"]["cycles"]


def _strict_json(text: str):
    """json.loads refusing NaN and Infinity: Python writes them, JSON (RFC 8259) has no such values."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_json_with_nothing_to_decode_is_valid_json(ckpt, capsys, monkeypatch):
    """--max-new-tokens 1: the one token comes out of the prefill and no cycle runs, so there is no acceptance to
    average and no cycle cost to time. The document says so with nulls (NaN is not JSON) and shows no cost table
    (the placeholder the policy runs on is not a measurement) where no earlier run kept one."""
    monkeypatch.setattr(adaptive_costs, "_MEMORY", {})  # the tables earlier tests' runs kept in this process
    code, out, err = cli_json(capsys, "--model", ckpt / "model", "--prompt", PROMPT, "--max-new-tokens", 1,
                              "--speculative-num-steps", 1, "--json")
    assert code == 0, err
    doc = _strict_json(out)
    _check_schema(doc, JSON_SCHEMA)
    assert doc["timings"]["cycles"] == 0 and len(doc["results"][0]["tokens"]) == 1
    assert doc["acceptance"]["per_position"] == [None]
    ad = doc["adaptive"]
    assert ad["cost_source"] == "none" and ad["costs_ms"] is None and ad["first_run_ms"] is None
    assert ad["expected_tokens_per_s"] is None


def _printed_speedup(stderr: str) -> tuple[float, float, float, float]:
    """(mean acceptance length, speedup, its min, its max) as the statistics lines print them."""
    mal = float(re.search(r"mean acceptance length ([0-9.]+)", stderr).group(1))
    m = re.search(r"-> speedup ([0-9.]+)x \(([0-9.]+)-([0-9.]+)x over 3 rounds\)", stderr)
    assert m, stderr
    return mal, *map(float, m.groups())


def test_streaming_text_and_statistics(ckpt, library):
    text = load_tokenizer(ckpt / "model").decode(library(PROMPT))
    r = cli("--model", ckpt / "model", "--max-new-tokens", MAX_NEW, "--speculative-num-steps", 3, "--baseline",
            "--baseline-rounds", 3, "--no-speculative-adaptive", stdin=PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == text + "\n"  # a pipe: no echoed prompt, no escape codes
    for needle in ("prompt tokens:", "prefill:", "compile:", "tok/s", "mean acceptance length", "ms/cycle", "baseline"):
        assert needle in r.stderr
    assert "both streamed, median of 3 interleaved rounds" in r.stderr  # like with like
    # the figure is a timing (its method, which keeps it within the acceptance length: tests/test_speedup_method.py)
    mal, speedup, low, high = _printed_speedup(r.stderr)
    assert low <= speedup <= high and mal >= 1.0


def test_baseline_in_the_device_loop_reports_its_rounds(ckpt, capsys):
    code, out, err = cli_json(capsys, "--model", ckpt / "model", "--prompt", PROMPT, "--max-new-tokens", MAX_NEW,
                              "--speculative-num-steps", 3, "--baseline", "--baseline-rounds", 3, "--json",
                              "--no-speculative-adaptive")
    assert code == 0, err
    doc = json.loads(out)
    b, mal = doc["baseline"], doc["acceptance"]["mean_acceptance_length"]
    assert b["mode"] == "device loop" and b["rounds"] == 3
    assert b["speedup_min"] <= b["speedup"] <= b["speedup_max"] and mal >= 1.0  # a timing: see test_speedup_method


def test_batch_file_matches_single_prompts(ckpt, library, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(BATCH) + "\n")
    code, out, err = cli_json(capsys, "--model", ckpt / "model", "--batch-file", f, "--max-new-tokens", MAX_NEW,
                              "--dtype", "float32", "--json", "--no-speculative-adaptive")
    assert code == 0, err
    got = [x["tokens"] for x in json.loads(out)["results"]]
    assert got == [library(p) for p in BATCH]


def test_chat_template_is_applied(ckpt, capsys):
    # the plain programs the library compiled for BATCH's longest prompt (same bucket): nothing to compile
    code, out, err = cli_json(capsys, "--model", ckpt / "model", "--prompt", "hi", "--chat", "--max-new-tokens",
                              MAX_NEW, "--speculative-num-steps", 0, "--json")
    assert code == 0, err
    doc = json.loads(out)
    tok = load_tokenizer(ckpt / "model")
    assert doc["results"][0]["prompt_tokens"] == len(tok.encode("<|im_user|>user<|im_middle|>hi<|im_end|>"
                                                                 "<|im_assistant|>assistant<|im_middle|>"))


ERRORS = [
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "-2"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prefill-chunk", "100"], "--prefill-chunk"),
    (["--speculative-eagle-topk", "4"], "--speculative-eagle-topk"),
    (["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "6"], "--speculative-num-draft-tokens"),
    (["--speculative-adaptive", "--speculative-num-steps", "0"], "--speculative-adaptive needs"),
    (["--no-speculative-adaptive", "--speculative-adaptive-costs", '{"0": 1}'], "--speculative-adaptive-costs needs"),
    (["--speculative-num-steps", "0", "--speculative-adaptive-costs", '{"0": 1}'], "--speculative-adaptive-costs needs"),
    (["--speculative-adaptive-costs", '{"0": 1}'], "compiled set is K = [0, 1, 2, 3, 4]"),
    (["--speculative-adaptive", "--speculative-adaptive-costs", '{"0": 1}'], "compiled set is K = [0, 1, 2, 3, 4]"),
    (["--speculative-adaptive", "--speculative-adaptive-costs", "/nonexistent/costs.json"], "readable file"),
    (["--baseline", "--speculative-num-steps", "0"], "--baseline compares speculative decoding with plain"),
    (["--baseline", "--baseline-rounds", "0"], "--baseline-rounds"),
    (["--baseline", "--max-new-tokens", "1"], "--baseline needs --max-new-tokens >= 2"),
    (["--max-context", "0"], "--max-context must be >= 2"),
    (["--moe-kernel", "fast"], "--moe-kernel"),
    (["--mesh", "3x"], "--mesh"),
    (["--mesh", "64"], "needs 64 devices"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
    (["--model", "/nonexistent/model"], "no such checkpoint"),
    (["--model", __file__], "not a directory"),
    (["--draft", __file__], "--draft"),
    (["--speculative-num-draft-tokens", "-3"], "--speculative-num-draft-tokens must be >= 1"),
]


@pytest.mark.parametrize("args, needle", ERRORS, ids=[e[1] for e in ERRORS])
def test_bad_flags_exit_2_with_one_line(args, needle, capsys):
    code, err = cli_in_process(capsys, *args, *([] if "--prompt-file" in args else ["--prompt", "x"]))
    assert code == 2
    assert err.startswith("error: ") and needle in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_bad_flag_from_the_command_line_exits_2_with_one_line():
    r = cli("--top-p", "1.5", "--prompt", "x")
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "--top-p" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_checkpoint_and_draft_errors(ckpt, tmp_path, capsys):
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    cases = [
        (["--model", incomplete], "CONVERSION_COMPLETE"),
        (["--model", ckpt / "model", "--draft", ckpt / "bad_hidden"], "hidden size"),
        (["--model", ckpt / "model", "--draft", ckpt / "bad_vocab"], "vocab_size"),
        (["--model", ckpt / "model", "--draft", ckpt / "bad_aux"], "aux layers"),
        (["--model", ckpt / "model", "--max-context", 40, "--max-new-tokens", 30, "--prompt", "the " * 12],
         "exceeds the context"),
        (["--model", ckpt / "model", "--draft", ckpt / "model"], "not a draft"),
        (["--model", ckpt / "model", "--max-context", 10**6], "exceeds the model's"),
    ]
    for args, needle in cases:
        code, err = cli_in_process(capsys, *args, *([] if "--prompt" in args else ["--prompt", "x"]))
        assert code == 2, (args, err)
        assert err.strip().splitlines()[-1].startswith("error: ") and needle in err, (args, err)
        assert "Traceback" not in err
    # one of them from the command line: the exit status and all of stderr, after loading a checkpoint
    r = cli("--model", ckpt / "model", "--draft", ckpt / "bad_aux", "--prompt", "x")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "aux layers" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
