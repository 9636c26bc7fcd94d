"""jaxspec.sharded.compile_programs: each program handed to XLA as soon as it is lowered, side by side; the programs
come back in the order given, and a program that cannot be lowered fails the set with its own error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sharded import compile_programs


def test_the_programs_come_back_in_order_and_compute_their_functions():
    x = jnp.arange(6, dtype=jnp.float32)
    specs = [(lambda v, k=k: v * k + k, (jax.ShapeDtypeStruct(x.shape, x.dtype),), ()) for k in range(1, 5)]
    programs = compile_programs(specs)
    assert len(programs) == 4
    for k, program in enumerate(programs, start=1):
        np.testing.assert_array_equal(np.asarray(program(x)), np.asarray(x) * k + k)


def test_a_program_that_cannot_be_lowered_fails_the_set_with_its_error():
    def broken(v):
        raise ValueError("no such shape")

    shape = (jax.ShapeDtypeStruct((3,), jnp.float32),)
    with pytest.raises(ValueError, match="no such shape"):
        compile_programs([(lambda v: v + 1, shape, ()), (broken, shape, ()), (lambda v: v * 2, shape, ())])
