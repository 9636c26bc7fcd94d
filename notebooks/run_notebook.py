"""Execute notebooks/benchmark.ipynb headless and write the executed copy elsewhere (never over the committed one).

    python notebooks/run_notebook.py --model k25-random --layers 4 --out notebooks/figures/gpu \\
        --executed /tmp/benchmark.executed.ipynb                     # on a GPU (real K2.5 dims)
    python notebooks/run_notebook.py --model k25-random --tiny --layers 3 --tokens 1,2,3,4 --ks 1,2,3 \\
        --context 64 --iters 3 --executed out/notebook/executed.ipynb   # on a CPU (bench.step.TINY_DIMS)

The plots and results.json go to --out, by default out/notebook/ (ignored by git): a run never rewrites the
figures committed under notebooks/figures/ unless --out names them.

Each option sets the notebook's JAXSPEC_NB_* environment variable (see its parameter cell). By default the
notebook runs in a Jupyter kernel through nbclient; `--as-script` runs its code cells in order in this process
instead (for machines without nbclient / ipykernel) and still writes an executed notebook with each cell's
printed output. Exit status 1 when a cell fails (the executed copy up to that cell is still written).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "benchmark.ipynb"
REPO = HERE.parent

OPTIONS = {  # option -> environment variable the parameter cell reads
    "model": "JAXSPEC_NB_MODEL",
    "model_dir": "JAXSPEC_NB_MODEL_DIR",
    "layers": "JAXSPEC_NB_LAYERS",
    "out": "JAXSPEC_NB_OUT",
    "tokens": "JAXSPEC_NB_TOKENS",
    "ks": "JAXSPEC_NB_KS",
    "context": "JAXSPEC_NB_CONTEXT",
    "iters": "JAXSPEC_NB_ITERS",
    "max_new_tokens": "JAXSPEC_NB_MAX_NEW_TOKENS",
    "repeats": "JAXSPEC_NB_REPEATS",
    "budget_s": "JAXSPEC_NB_BUDGET_S",
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--executed", type=Path, required=True, help="where the executed notebook goes")
    p.add_argument("--model", choices=["auto", "default", "k25-random"])
    p.add_argument("--model-dir", help="the default pair's directory (default jaxspec/default_model)")
    p.add_argument("--layers", type=int)
    p.add_argument("--tiny", action="store_true", help="bench.step.TINY_DIMS (CPU)")
    p.add_argument("--out", help="directory for the plots and results.json (default out/notebook, ignored by git)")
    p.add_argument("--tokens", help="comma-separated T for the decode/verify steps (default 1,...,8)")
    p.add_argument("--ks", help="comma-separated draft lengths K for the cycles (default 1 .. generate's K)")
    p.add_argument("--context", type=int)
    p.add_argument("--iters", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--budget-s", type=float, help="start no new configuration after this many seconds")
    p.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds (nbclient)")
    p.add_argument("--as-script", action="store_true", help="run the code cells in this process, no kernel")
    a = p.parse_args(argv)
    check_options(p, a)
    return a


def _ints(p, flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag} {text!r}: expected comma-separated integers")


def check_options(p, a) -> None:
    """What the notebook cannot run with, refused here in one line naming the option: inside the notebook each is a
    traceback in a cell (a median of no calls, no decode step to compare with, a draft tapping layers the target
    lacks), after the model is loaded."""
    if a.tokens is not None:
        tokens = _ints(p, "--tokens", a.tokens)
        if not tokens or min(tokens) < 1 or 1 not in tokens:
            p.error(f"--tokens {a.tokens!r}: T >= 1, and 1 among them (the decode step every ratio is taken to)")
    if a.ks is not None and min(_ints(p, "--ks", a.ks), default=1) < 1:
        p.error(f"--ks {a.ks!r}: draft lengths K >= 1")
    for flag, value, least in (("--iters", a.iters, 1), ("--repeats", a.repeats, 1), ("--context", a.context, 0),
                               ("--max-new-tokens", a.max_new_tokens, 2), ("--budget-s", a.budget_s, 0),
                               ("--layers", a.layers, 3)):  # the draft taps three distinct target layers
        if value is not None and value < least:
            p.error(f"{flag} must be >= {least}, got {value}")


def notebook_env(args) -> dict[str, str]:
    env = {var: str(getattr(args, opt)) for opt, var in OPTIONS.items() if getattr(args, opt) is not None}
    if args.tiny:
        env["JAXSPEC_NB_TINY"] = "1"
    return env


def execute_in_kernel(nb, timeout: int) -> None:
    """Run `nb` in a local Jupyter kernel (cwd = the repository). The kernel talks to this process over IPC
    sockets in a private temporary directory: over TCP, ipykernel warns that the traffic is unencrypted."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory(prefix="jaxspec-kernel-") as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
        NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(REPO)}}).execute()


def run_with_nbclient(executed: Path, timeout: int) -> int:
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(NOTEBOOK, as_version=4)
    status = 0
    try:
        execute_in_kernel(nb, timeout)
    except CellExecutionError as e:
        print(e, file=sys.stderr)
        status = 1
    nbformat.write(nb, executed)
    return status


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()


def run_as_script(executed: Path) -> int:
    """Exec each code cell in one namespace (cwd = repo), printing as it goes; record outputs like a kernel."""
    nb = json.loads(NOTEBOOK.read_text())
    namespace = {"__name__": "__main__"}
    os.chdir(REPO)
    status, count = 0, 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        count += 1
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        buf = io.StringIO()
        print(f"--- cell {count} ---", flush=True)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(_Tee(sys.__stdout__, buf)):
            try:
                exec(compile(source, f"<cell {count}>", "exec"), namespace)
                error = None
            except Exception as e:  # noqa: BLE001 - reported as the cell's error output
                error = e
                tb = traceback.format_exc()
        cell["execution_count"] = count
        cell["outputs"] = []
        if buf.getvalue():
            cell["outputs"].append({"output_type": "stream", "name": "stdout", "text": buf.getvalue()})
        if error is not None:
            print(tb, file=sys.stderr, flush=True)
            cell["outputs"].append({"output_type": "error", "ename": type(error).__name__, "evalue": str(error),
                                    "traceback": tb.splitlines()})
            status = 1
            break
        print(f"--- cell {count}: {time.perf_counter() - t0:.1f} s ---", flush=True)
    executed.write_text(json.dumps(nb, indent=1) + "\n")
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    executed = args.executed.resolve()
    if executed == NOTEBOOK:
        sys.exit(f"--executed {args.executed}: that is the committed notebook (kept with cleared outputs)")
    executed.parent.mkdir(parents=True, exist_ok=True)
    os.environ.update(notebook_env(args))
    t0 = time.perf_counter()
    status = run_as_script(executed) if args.as_script else run_with_nbclient(executed, args.timeout)
    print(f"{'ran' if status == 0 else 'FAILED'}: {NOTEBOOK.name} -> {executed} in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
