"""The engine's programs on a device mesh: weights placed by the partition rules, every program compiled
with explicit in/out shardings so the state carried between cycles keeps its layout, and traced inside
the mesh so the model's expert-parallel MoE (model/moe_parallel.py) finds it.

Works the same with one process or several (`jax.distributed`): arrays that span other processes'
devices are assembled from the host value every process holds alike.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxspec.models import SpecWeights
from model.attention_mla import fuse_input_projections
from model.decoder import fuse_attention_inputs
from model.sharding import DRAFT_RULES, STATE_RULES, TARGET_RULES, mesh_context, shardings_for


def weight_shardings(weights: SpecWeights, mesh: Mesh) -> SpecWeights:
    """Target by TARGET_RULES (experts over every device, heads / FFN / vocab over "model"); draft replicated."""
    draft = None if weights.draft is None else shardings_for(weights.draft, mesh, DRAFT_RULES)
    return SpecWeights(target=shardings_for(weights.target, mesh, TARGET_RULES), draft=draft)


def arg_shardings(args: tuple, mesh: Mesh) -> tuple:
    """Weights by the weight rules; states (and anything else) by STATE_RULES, which replicate what they
    do not name (prompt tokens, sampling parameters, keys)."""
    return tuple(weight_shardings(a, mesh) if isinstance(a, SpecWeights) else shardings_for(a, mesh, STATE_RULES)
                 for a in args)


def _host_value(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def put(x, sharding: NamedSharding):
    """`x` laid out as `sharding`; untouched when it already is (weights loaded straight onto the mesh)."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = put(jax.random.key_data(x), NamedSharding(sharding.mesh, sharding.spec))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    # several processes: each one fills the shards of its own devices from its copy of the value
    host = _host_value(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree, shardings):
    return jax.tree_util.tree_map(put, tree, shardings)


def place_weights(weights: SpecWeights, mesh: Mesh) -> SpecWeights:
    return place(weights, weight_shardings(weights, mesh))


def weights_to_run(weights: SpecWeights, mesh: Mesh | None) -> SpecWeights:
    """The weights as the engines run them: placed by the partition rules over `mesh` (when there is one), then
    the attention input projections fused, the target's (`model.decoder.fuse_attention_inputs`) and an MLA
    draft's (`model.attention_mla.fuse_input_projections`); a fused weight keeps the replicated placement of its
    parts. The caller's unfused arrays are freed once it drops them."""
    placed = weights if mesh is None else place_weights(weights, mesh)
    draft = placed.draft
    if draft is not None and draft.mla is not None:
        draft = draft.replace(mla=fuse_input_projections(draft.mla))
    return placed.replace(target=fuse_attention_inputs(placed.target), draft=draft)


def _abstract(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


class MeshProgram:
    """A compiled program that first lays its arguments out as it was compiled for (a no-op for the
    weights and the state it produced itself)."""

    def __init__(self, compiled, in_shardings: tuple):
        self.compiled, self.in_shardings = compiled, in_shardings

    def __call__(self, *args):
        return self.compiled(*place(args, self.in_shardings))


def lower_program(fn, args: tuple, donate: tuple = (), mesh: Mesh | None = None):
    """Trace and lower `fn(*args)` (arrays or their shapes): as a plain jit without a mesh, else with the rule
    shardings in and STATE_RULES out (in host memory where the program put an output there), traced inside the
    mesh. Returns (the lowered program, its in-shardings or None without a mesh)."""
    if mesh is None:
        return jax.jit(fn, donate_argnums=donate).lower(*args), None
    in_shardings = arg_shardings(args, mesh)
    abstract = _abstract(args)
    with mesh_context(mesh):
        traced = jax.jit(fn).trace(*abstract)
        out_avals = jax.tree_util.tree_unflatten(traced.out_tree, traced.jaxpr.out_avals)
        out_shardings = jax.tree_util.tree_map(_in_its_memory, shardings_for(out_avals, mesh, STATE_RULES), out_avals)
        jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate)
        return jitted.lower(*abstract), in_shardings


def _in_its_memory(sharding: NamedSharding, aval) -> NamedSharding:
    """An output's sharding in host memory where the program wrote it there (`jaxspec.state.on_host`): an explicit
    device sharding would move it back to the device, and the host's read would be a device transfer again."""
    on_host = getattr(aval, "memory_space", None) == jax.memory.Space.Host
    return sharding.with_memory_kind("pinned_host") if on_host else sharding


def output_shapes(fn, args: tuple, mesh: Mesh | None = None):
    """What `fn(*args)` returns, as shapes (nothing runs), traced inside `mesh` as its program would be."""
    if mesh is None:
        return jax.eval_shape(fn, *args)
    with mesh_context(mesh):
        return jax.eval_shape(fn, *args)


def compile_programs(specs: list[tuple], mesh: Mesh | None = None) -> list:
    """Ahead-of-time compile each `(fn, args, donate)` of `specs` (`lower_program`). JAX traces and lowers them one
    after another, and XLA compiles each as soon as it is lowered, side by side, one thread each (a program's
    optimisation passes run on one core, and at Kimi's depth each takes tens of seconds), or loads it from the
    persistent cache. So a set's build overlaps the later programs' lowering, and on a GPU the programs' GEMM
    autotuning does not all run on the device at once: a later program finds in the process's autotuning cache what
    an earlier one already timed (docs/performance.md, "Each block priced for its own observations; the set's
    build, cold")."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(specs), os.cpu_count() or 1)))
    try:
        started = []
        for fn, args, donate in specs:
            lowered, in_shardings = lower_program(fn, args, donate, mesh)
            started.append((pool.submit(lowered.compile), in_shardings))
        compiled = [(job.result(), ins) for job, ins in started]
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # the error now: no queued build runs for a set that failed
        raise
    pool.shutdown()
    return [c if ins is None else MeshProgram(c, ins) for c, ins in compiled]


def compile_program(fn, args: tuple, donate: tuple = (), mesh: Mesh | None = None):
    """Ahead-of-time compile `fn(*args)` (`lower_program`)."""
    lowered, in_shardings = lower_program(fn, args, donate, mesh)
    compiled = lowered.compile()
    return compiled if in_shardings is None else MeshProgram(compiled, in_shardings)
