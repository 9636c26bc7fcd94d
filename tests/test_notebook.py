"""notebooks/benchmark.ipynb executed headless (nbclient, a real Jupyter kernel) on CPU with a small parameter set:
every code cell ran without an error, the device is named in the output, and every plot file was written."""

import datetime
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "benchmark.ipynb"
PLOTS = ("tok_per_s_vs_k.png", "acceptance_histogram.png", "verify_decode_ratio.png", "break_even.png")
CI_PARAMS = {  # tiny K2.5 dims, 3 layers (the least the draft's three aux layers need); ~50 s on 2 CPU cores
    "JAXSPEC_NB_MODEL": "k25-random",
    "JAXSPEC_NB_TINY": "1",
    "JAXSPEC_NB_LAYERS": "3",
    "JAXSPEC_NB_TOKENS": "1,2",
    "JAXSPEC_NB_KS": "1,2",
    "JAXSPEC_NB_CONTEXT": "32",
    "JAXSPEC_NB_ITERS": "2",
}


def test_committed_notebook_has_no_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in code)


def _run_notebook_module():
    spec = importlib.util.spec_from_file_location("run_notebook", REPO / "notebooks" / "run_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notebook_executes_headless_on_cpu(tmp_path, monkeypatch):
    import nbformat

    out = tmp_path / "figures"
    for var, value in {**CI_PARAMS, "JAXSPEC_NB_OUT": str(out), "JAX_PLATFORMS": "cpu"}.items():
        monkeypatch.setenv(var, value)  # the kernel inherits this process's environment
    # one CPU device is enough here; conftest's compile options stay
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform")]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # as run_notebook.py runs it (IPC, cwd = the repo); the timeout only catches a hung cell, it times nothing
    _run_notebook_module().execute_in_kernel(nb, timeout=600)
    nbformat.write(nb, tmp_path / "executed.ipynb")

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "device: cpu" in text and "jax " in text
    for name in PLOTS:
        assert (out / name).stat().st_size > 10_000, name
    results = json.loads((out / "results.json").read_text())
    assert results["device"] == "cpu" and set(results["cycles"]) == {"1", "2"} and set(results["steps"]) == {"1", "2"}
    assert all(r["median_ms"] > 0 for r in [*results["steps"].values(), *results["cycles"].values()])
    # a result carries its date and, beside each floor, the ratio to it, as bench.step's rows do
    assert datetime.datetime.fromisoformat(results["date"]).tzinfo is not None
    for r in [*results["steps"].values(), *results["cycles"].values()]:
        for key in ("4p3", "copy"):
            assert r[f"ratio_{key}"] == pytest.approx(r["median_ms"] / r[f"floor_ms_{key}"])


def test_the_run_the_notebook_cites_is_the_one_it_links():
    """The markdown cell showing a committed bench figure names that run's date: the date in its result JSON."""
    nb = json.loads(NOTEBOOK.read_text())
    cited = [c for c in nb["cells"] if c["cell_type"] == "markdown" and "](../bench/results/" in "".join(c["source"])]
    assert cited
    for cell in cited:
        text = "".join(cell["source"])
        for link in re.findall(r"\]\((\.\./bench/results/[^)]+\.png)\)", text):
            doc = json.loads((NOTEBOOK.parent / link).with_suffix(".json").read_text())
            assert doc["date"][:10] in text, (link, doc["date"])


def test_run_notebook_refuses_bad_options_in_one_line(tmp_path, capsys):
    """Options the notebook could not run with are refused before it starts, naming the option (each was a
    traceback in a cell: a median of no calls, no decode step, too few layers for the draft, a T that is no number),
    and no executed copy is written."""
    module = _run_notebook_module()
    executed = tmp_path / "executed.ipynb"
    for argv, flag in ((["--iters", "0"], "--iters"), (["--tokens", "2,4"], "--tokens"),
                       (["--tokens", "1,x"], "--tokens"), (["--ks", "0,1"], "--ks"), (["--layers", "2"], "--layers"),
                       (["--repeats", "0"], "--repeats"), (["--max-new-tokens", "1"], "--max-new-tokens"),
                       (["--context", "-1"], "--context")):
        with pytest.raises(SystemExit) as e:
            module.main(["--executed", str(executed), *argv])
        assert e.value.code == 2 and flag in capsys.readouterr().err, argv
    assert not executed.exists()
