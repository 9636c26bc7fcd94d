"""bench.labs.sharded_census's reading of an optimised HLO module's collectives (its GPU compile needs jax's CUDA
plugin, which CI does not install): a GPU module's asynchronous collectives with XLA's kernel strategy, and a
program compiled for the 8 CPU devices, whose collectives are synchronous."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from bench.labs.sharded_census import collectives, heavy_collectives, largest_array_bytes, parse_args
from model.sharding import make_mesh

# the shape of what the GPU compiler prints (abridged): an all-gather of a table before a loop whose body
# all-reduces one row with a one-shot kernel
_GPU_HLO = """
%region_body (p: (s32[], bf16[1,7168])) -> (s32[], bf16[1,7168]) {
  %p = (s32[], bf16[1,7168]{1,0}) parameter(0)
  %x = bf16[1,7168]{1,0} get-tuple-element(%p), index=1
  %all-reduce-start = bf16[1,7168]{1,0} all-reduce-start(%x), channel_id=1, backend_config={CONFIG_ONE_SHOT}
  %all-reduce-done = bf16[1,7168]{1,0} all-reduce-done(%all-reduce-start)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[1,7168]{1,0}) tuple(%i, %all-reduce-done)
}

%region_cond (p: (s32[], bf16[1,7168])) -> pred[] {
  %p = (s32[], bf16[1,7168]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (w: bf16[20480,7168], x: bf16[1,7168]) -> bf16[163840,7168] {
  %w = bf16[20480,7168]{1,0} parameter(0)
  %x = bf16[1,7168]{1,0} parameter(1)
  %all-gather-start = (bf16[20480,7168]{1,0}, bf16[163840,7168]{1,0}) all-gather-start(%w), backend_config={CONFIG}
  %all-gather-done = bf16[163840,7168]{1,0} all-gather-done(%all-gather-start)
  %z = s32[] constant(0)
  %init = (s32[], bf16[1,7168]{1,0}) tuple(%z, %x)
  %loop = (s32[], bf16[1,7168]{1,0}) while(%init), condition=%region_cond, body=%region_body
  ROOT %r = bf16[163840,7168]{1,0} copy(%all-gather-done)
}
"""
_STRATEGY = '{"collective_backend_config":{"kernel_strategy":"KERNEL_STRATEGY_%s"}}'
_GPU_HLO = _GPU_HLO.replace("{CONFIG_ONE_SHOT}", _STRATEGY % "TRITON_ONE_SHOT")
_GPU_HLO = _GPU_HLO.replace("{CONFIG}", _STRATEGY % "DEFAULT")


def test_gpu_collectives_read_with_their_bytes_kernel_and_place():
    found = collectives(_GPU_HLO)
    assert [(c["op"], c["bytes"], c["strategy"], c["in_loop"]) for c in found] == [
        ("all-reduce", 7168 * 2, "triton_one_shot", True),
        ("all-gather", 163840 * 7168 * 2, "default", False)]
    rows = [dict(program="p", collectives=found)]
    assert heavy_collectives(rows, 16.0) == []  # the big gather is outside the loop
    found[1]["in_loop"] = True
    assert heavy_collectives(rows, 16.0) == [("p", "all-gather", 163840 * 7168 * 2 / 2 ** 20)]


def test_largest_array_bytes():
    assert largest_array_bytes("((f32[1]{0}, s32[1]{0}), (f32[8]{0}, s32[8]{0}))") == 32
    assert largest_array_bytes("pred[]") == 1
    assert largest_array_bytes("token[]") == 0


def test_cpu_program_collectives_in_and_out_of_a_loop():
    """A psum in a loop's body and one after it, over the 8 CPU devices (XLA:CPU's synchronous collectives)."""
    mesh = make_mesh((1, 8))

    def per_device(x):
        x = jax.lax.fori_loop(0, 3, lambda _, v: jax.lax.psum(v, "model") * 0.125, x)
        return jax.lax.psum(x * x, "model")

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("model"), out_specs=P(), check_vma=False))
    x = jax.device_put(jnp.ones((8, 16), jnp.float32), NamedSharding(mesh, P("model")))
    found = collectives(fn.lower(x).compile().as_text())
    assert sorted((c["op"], c["in_loop"]) for c in found) == [("all-reduce", False), ("all-reduce", True)]
    assert all(c["bytes"] == 16 * 4 for c in found)


@pytest.mark.parametrize("argv", [["--layers", "4"], ["--devices", "1"]])
def test_parse_args_refuses(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)
