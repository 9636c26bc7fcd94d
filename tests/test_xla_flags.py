"""The engine's XLA flags (`jaxspec.xla_flags`): added where the user set none, the autotune cache directory chosen
from the environment, and a warning when they come too late to take effect."""

import os
import subprocess
import sys

import pytest

from jaxspec import xla_flags
from jaxspec.xla_flags import AUTOTUNE_CACHE_ENV, AUTOTUNE_CACHE_FLAG, SCHEDULING_FLAG


def test_flags_added_where_the_user_set_none(tmp_path):
    assert xla_flags.engine_xla_flags("", tmp_path).split() == [f"{SCHEDULING_FLAG}=CONCURRENT",
                                                                  f"{AUTOTUNE_CACHE_FLAG}={tmp_path}"]
    user = f"--xla_force_host_platform_device_count=8 {SCHEDULING_FLAG}=LHS {AUTOTUNE_CACHE_FLAG}=/mine"
    assert xla_flags.engine_xla_flags(user, tmp_path) == user
    assert xla_flags.engine_xla_flags("", None) == f"{SCHEDULING_FLAG}=CONCURRENT"


def test_autotune_cache_directory_from_the_environment(tmp_path):
    assert xla_flags.default_autotune_cache_dir({AUTOTUNE_CACHE_ENV: "off"}) is None
    assert xla_flags.default_autotune_cache_dir({AUTOTUNE_CACHE_ENV: str(tmp_path / "c")}) == tmp_path / "c"
    default = xla_flags.default_autotune_cache_dir({"XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cuda"})
    assert default.parent == tmp_path / "jaxspec" / "xla-autotune" and default.name.startswith("jaxlib-0.")
    # XLA:CPU does not autotune: a CPU-only process gets no cache directory unless the user names one
    assert xla_flags.default_autotune_cache_dir({"XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}) is None


def test_apply_creates_the_directory_and_keeps_a_user_setting(tmp_path):
    env = {AUTOTUNE_CACHE_ENV: str(tmp_path / "autotune"), "XLA_FLAGS": f"{SCHEDULING_FLAG}=LHS"}
    with pytest.warns(UserWarning, match="import jaxspec first"):  # this test process's backend has started
        import jax.numpy as jnp

        jnp.ones(1).block_until_ready()
        flags = xla_flags.apply(env)
    assert flags.split() == [f"{SCHEDULING_FLAG}=LHS", f"{AUTOTUNE_CACHE_FLAG}={tmp_path / 'autotune'}"]
    assert (tmp_path / "autotune").is_dir() and env["XLA_FLAGS"] == flags


def test_unwritable_cache_directory_leaves_the_cache_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {AUTOTUNE_CACHE_ENV: str(blocker / "sub"), "XLA_FLAGS": ""}
    with pytest.warns(UserWarning):
        assert xla_flags.apply(env) == f"{SCHEDULING_FLAG}=CONCURRENT"


def test_a_cache_path_with_whitespace_is_not_passed_to_xla(tmp_path):
    env = {AUTOTUNE_CACHE_ENV: str(tmp_path / "my cache"), "XLA_FLAGS": f"{SCHEDULING_FLAG}=LHS"}
    assert xla_flags.apply(env) == f"{SCHEDULING_FLAG}=LHS" and not (tmp_path / "my cache").exists()


def test_importing_jaxspec_sets_the_flags_before_jax_starts(tmp_path):
    code = ("import os, jaxspec, jax, jax.numpy as jnp; print(int(jnp.arange(4).sum())); "
            "print(os.environ['XLA_FLAGS'])")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           AUTOTUNE_CACHE_ENV: str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    assert out[0] == "6"  # XLA accepted the flags
    assert out[1].split() == ["--xla_force_host_platform_device_count=2", f"{SCHEDULING_FLAG}=CONCURRENT",
                              f"{AUTOTUNE_CACHE_FLAG}={tmp_path / 'cache'}"]


def test_importing_jaxspec_on_a_cpu_machine_creates_no_cache_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (AUTOTUNE_CACHE_ENV, "XDG_CACHE_HOME")}
    env.update(HOME=str(tmp_path), JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run([sys.executable, "-c", "import os, jaxspec; print(os.environ['XLA_FLAGS'])"], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert AUTOTUNE_CACHE_FLAG not in out and not (tmp_path / ".cache").exists()
