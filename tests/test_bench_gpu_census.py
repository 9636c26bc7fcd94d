"""bench.labs.gpu_census's reading of an optimised HLO module (the compile for a GPU needs jax's CUDA plugin, which
CI does not install; what it reads is checked here on programs compiled for the CPU)."""

import jax
import jax.numpy as jnp

from bench.labs.gpu_census import Kernel, graph_shape, kernels_in_order, kernels_in_series, layer_segments
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


_HLO = """
%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (x: f32[4], y: f32[4]) -> (f32[4], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  %a = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %v = f32[4]{0} bitcast(%a)
  %b = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused_a
  %t = (f32[4]{0}, f32[4]{0}) tuple(%b, %y)
  %g = f32[4]{0} get-tuple-element(%t), index=0
  %c = f32[4]{0} custom-call(%g, %x), custom_call_target="k"
  %side = f32[4]{0} fusion(%y), kind=kLoop, calls=%fused_a
  ROOT %out = (f32[4]{0}, f32[4]{0}) tuple(%c, %side)
}
"""


def test_kernels_in_series_follow_the_longest_chain():
    """a -> (a view) -> b -> (a tuple) -> c is three kernels in series; `side` runs beside them."""
    assert kernels_in_series(_HLO) == 3
    assert len(kernels_in_order(_HLO)) == 4


def test_graph_shape_counts_edges_joins_and_forks():
    """In _HLO a -> b -> c is a chain beside `side`: two edges, no join, no fork. Give c a second branch from a
    (d) and a waits for nothing, feeds b and d (a fork), and c waits for both (a join)."""
    assert graph_shape(_HLO) == dict(edges=2, joins=0, forks=0)
    forked = _HLO.replace('%c = f32[4]{0} custom-call(%g, %x)', '%d = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_a\n'
                          '  %c = f32[4]{0} custom-call(%g, %d)')
    assert graph_shape(forked) == dict(edges=4, joins=1, forks=1)
    assert kernels_in_series(forked) == 3


def test_a_wide_fusion_body_is_not_the_busiest_computation():
    """A fusion whose body holds more operations than the loop or entry launches kernels (an unrolled element-wise
    computation) runs as one kernel: the chain is still read from the computation that launches them."""
    ops = "\n".join(f"  %n{i} = f32[4]{{0}} negate(%n{i - 1})" for i in range(1, 9))
    wide = _HLO.replace("  ROOT %n = f32[4]{0} negate(%p)", "  %n0 = f32[4]{0} negate(%p)\n" + ops
                        + "\n  ROOT %n = f32[4]{0} negate(%n8)")
    assert kernels_in_series(wide) == 3
    assert graph_shape(wide) == dict(edges=2, joins=0, forks=0)
