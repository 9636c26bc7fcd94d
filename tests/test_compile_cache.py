"""jaxspec.compile_cache: where the entry points keep compiled programs, and that a process pointed there writes
them (JAX's persistent cache) without overriding a cache the user gave JAX."""

import os
import subprocess
import sys
from pathlib import Path

from jaxspec.compile_cache import COMPILE_CACHE_ENV, compile_cache_dir

REPO = Path(__file__).resolve().parents[1]
# what a process runs between the entry points' start and their first compilation; JAX's one-second floor is
# lowered so the tiny program below is kept
PROBE = ("import jax; from jaxspec.compile_cache import enable; "
         "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
         "used = enable(); jax.jit(lambda x: x * 3 + 1)(2.0).block_until_ready(); print(used)")


def _probe(env_changes: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", COMPILE_CACHE_ENV)}
    env.update(env_changes, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_where_the_cache_lives():
    assert compile_cache_dir({COMPILE_CACHE_ENV: "off"}) is None and compile_cache_dir({COMPILE_CACHE_ENV: " "}) is None
    assert compile_cache_dir({COMPILE_CACHE_ENV: "/data/xc"}) == Path("/data/xc")
    assert compile_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/jaxspec/xla-compile")
    assert compile_cache_dir({}) == Path.home() / ".cache" / "jaxspec" / "xla-compile"


def test_a_process_keeps_its_programs_there(tmp_path):
    ours = tmp_path / "nested" / "xla-compile"
    assert _probe({COMPILE_CACHE_ENV: str(ours)}) == str(ours)
    assert any(ours.iterdir())  # the compiled program, kept for the next process


def test_off_and_the_users_own_cache_are_left_alone(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert _probe({COMPILE_CACHE_ENV: "off", "XDG_CACHE_HOME": str(tmp_path)}) == "None"
    assert not (tmp_path / "jaxspec").exists()
    assert _probe({COMPILE_CACHE_ENV: str(ours), "JAX_COMPILATION_CACHE_DIR": str(theirs)}) == str(theirs)
    assert not ours.exists() and any(theirs.iterdir())
