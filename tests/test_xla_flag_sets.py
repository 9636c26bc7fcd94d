"""The named XLA flag sets of the H200 A/B runs (`bench.labs.xla_flag_sets`): XLA knows every flag and value in them
(an unknown one would abort the process that reads XLA_FLAGS), and an unknown set name is refused."""

import os
import subprocess
import sys

import pytest

from bench.labs.xla_flag_sets import FLAG_SETS, NEWER_XLA_ONLY, flags_of


def test_xla_accepts_every_flag_set():
    """Every flag of every set, but those only jax 0.11's XLA knows (the H200 has jax 0.11, CI 0.10)."""
    import jax

    older_xla = jax.__version__.startswith("0.10.")
    flags = " ".join(f for f in flags_of(list(FLAG_SETS)).split() if not (older_xla and f.startswith(NEWER_XLA_ONLY)))
    assert "--xla_gpu_require_exclusive_lock=true" in flags.split()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "JAXSPEC_AUTOTUNE_CACHE": "off"}
    out = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(int(jnp.ones(3).sum()))"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr[-2000:]


def test_unknown_set_is_refused_by_name():
    with pytest.raises(KeyError, match="no-such-set"):
        flags_of(["lhs", "no-such-set"])
    shell = subprocess.run([sys.executable, "-m", "bench.labs.xla_flag_sets", "no-such-set"], capture_output=True,
                           text=True, timeout=60)
    assert shell.returncode != 0 and "no-such-set" in shell.stderr
    assert subprocess.run([sys.executable, "-m", "bench.labs.xla_flag_sets", "exclusive-lock"], capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip() == FLAG_SETS["exclusive-lock"]
