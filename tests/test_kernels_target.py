"""model.kernels.target: the platform a program's kernels are chosen and lowered for."""

import jax
import jax.numpy as jnp
import pytest

from model.config import Kernels
from model.configs import known_config
from model.kernels import target
from model.kernels.dispatch import mla_kernel_applies, router_kernel_applies
from model.kernels.target import compiling_for


def test_follows_the_default_backend_unless_named():
    assert target.platform() == jax.default_backend() == "cpu"
    assert target.interpret() and not target.on_hopper() and target.compute_capability() == ""
    with compiling_for("gpu", "9.0"):
        assert target.platform() == "gpu" and target.on_hopper() and not target.interpret()
        with compiling_for("gpu", "8.0"):  # nested: the innermost names the target
            assert not target.on_hopper() and target.compute_capability() == "8.0"
        assert target.on_hopper()
    assert target.platform() == "cpu"  # restored on leaving


def test_restored_when_the_block_raises():
    with pytest.raises(RuntimeError), compiling_for("gpu", "9.0"):
        raise RuntimeError("inside")
    assert target.platform() == "cpu"


def test_an_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="compiling_for: platform 'cuda'"):
        with compiling_for("cuda"):
            pass


def test_the_dispatch_reads_it():
    cfg = known_config("kimi-k2.5")
    assert not router_kernel_applies(Kernels(), 1, cfg)
    assert not mla_kernel_applies(Kernels(), 1, 1, 1024, cfg)
    with compiling_for("gpu", "9.0"):
        assert router_kernel_applies(Kernels(), 1, cfg)
        assert mla_kernel_applies(Kernels(), 1, 1, 1024, cfg)
        assert not router_kernel_applies(Kernels(router="off"), 1, cfg)


def test_a_gpu_target_lowers_the_router_kernel_for_cuda():
    """Traced under a GPU target, the router's top-k is its Triton kernel, not the interpreter's loop."""
    from model.router import route_by_kernels

    cfg = known_config("kimi-k2.5")
    sds = jax.ShapeDtypeStruct
    args = (sds((1, cfg.hidden_size), jnp.bfloat16), sds((cfg.n_routed_experts, cfg.hidden_size), jnp.bfloat16),
            sds((cfg.n_routed_experts,), jnp.float32))
    with compiling_for("gpu", "9.0"):
        text = jax.jit(lambda x, r, b: route_by_kernels(x, r, b, cfg)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    jax.clear_caches()
    assert "triton" in text
