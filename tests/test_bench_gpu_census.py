"""bench.labs.gpu_census's reading of an optimised HLO module (the compile for a GPU needs jax's CUDA plugin, which
CI does not install; what it reads is checked here on programs compiled for the CPU)."""

import jax
import jax.numpy as jnp

from bench.labs.gpu_census import Kernel, kernels_in_order, layer_segments
from bench.per_device import kernel_census


def _looped(x, w):
    def body(_, x):
        y = jnp.tanh(x @ w)
        return y / jnp.sum(y * y)

    return jax.lax.fori_loop(0, 3, body, x)


def test_kernels_in_order_are_what_kernel_census_counts():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    text = jax.jit(_looped).trace(x, w).lower().compile().as_text()
    kernels = kernels_in_order(text)
    assert kernels and all(isinstance(k, Kernel) for k in kernels)
    assert sum(kernel_census(text).values()) == len(kernels)
    assert {k.kind for k in kernels} == set(kernel_census(text))
    assert len({k.name for k in kernels}) == len(kernels)  # each instruction once, a loop's body once


def test_layer_segments_end_at_every_second_marker():
    k = lambda kind: Kernel(kind, kind, "f32[]")  # noqa: E731
    seq = [k("a"), k("mosaic_gpu_v2"), k("b"), k("mosaic_gpu_v2"), k("c"), k("d"), k("mosaic_gpu_v2"),
           k("mosaic_gpu_v2"), k("e")]
    segments = layer_segments(seq)
    assert [len(s) for s in segments] == [4, 4, 1]
    assert segments[-1][0].kind == "e"
    assert layer_segments([k("a")]) == [[k("a")]]
