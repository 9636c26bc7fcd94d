"""model/embedding.py on 8 simulated CPU devices: a vocabulary-sharded table's rows equal the plain lookup (negative
ids and ids past either end included), each device gathers from its own rows only, and the decoder's and the
draft's lookups of the target's table go that way in the sharded engine's programs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding, PartitionSpec as P

from bench import per_device as pd
from bench.cycle import spec_configs
from jaxspec.baseline_step import baseline_step
from jaxspec.models import SpecWeights
from jaxspec.prefill import baseline_prefill, spec_prefill
from jaxspec.sampling import SamplingParams
from jaxspec.spec_step import speculative_cycle
from model.decoder import fuse_attention_inputs
from model.embedding import embedding_rows
from model.init import init_draft_weights, init_kimi_weights
from model.sharding import make_mesh, mesh_context

V, H = 64, 8


def table(dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(0), (V, H), jnp.float32).astype(dtype)


def gather_operand_shapes(jaxpr) -> list[tuple]:
    """The operand shape of every gather in `jaxpr` and the jaxprs inside it (shard_map's, pjit's)."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("gather", "dynamic_slice"):
            shapes.append(tuple(eqn.invars[0].aval.shape))
        for sub in jaxprs_in_params(eqn.params):
            shapes += gather_operand_shapes(sub)
    return shapes


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sharded_rows_equal_the_plain_lookup(shape, dtype):
    """Every id of the vocabulary, a negative one and ones past either end: the rows of the table split over "model"
    (replicated over "data") are exactly the plain lookup's."""
    mesh = make_mesh(shape)
    t = table(dtype)
    tokens = jnp.asarray([[0, 7, 8, 63, -1, -64], [-65, 64, 1000, 31, 32, 15]], jnp.int32)
    want = np.asarray(t[tokens])
    placed = jax.device_put(t, NamedSharding(mesh, P("model", None)))
    fn = jax.jit(functools.partial(embedding_rows, vocab_sharded=True))
    with mesh_context(mesh):
        got = fn(placed, tokens)
        assert "shard_map" in str(jax.make_jaxpr(fn)(placed, tokens))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_each_device_gathers_from_its_own_rows():
    """Inside the mesh the lookup gathers from a [V / 8, H] block; the plain lookup of the same table gathers from
    the whole [V, H] (what GSPMD is left to partition, and on GPUs partitions by gathering the table)."""
    mesh = make_mesh((1, 8))
    placed = jax.device_put(table(), NamedSharding(mesh, P("model", None)))
    tokens = jnp.asarray([[5]], jnp.int32)
    with mesh_context(mesh):
        sharded = jax.make_jaxpr(lambda t, i: embedding_rows(t, i, vocab_sharded=True))(placed, tokens).jaxpr
        plain = jax.make_jaxpr(lambda t, i: t[i])(placed, tokens).jaxpr
    assert gather_operand_shapes(sharded) == [(V // 8, H)]
    assert gather_operand_shapes(plain) == [(V, H)]


def test_whole_table_is_looked_up_as_it_is():
    """A replicated table (vocab_sharded=False: the draft's own), no mesh, or a vocabulary the mesh does not divide:
    the plain lookup, no shard_map."""
    t, tokens = table(), jnp.asarray([[3, 60]], jnp.int32)
    odd = jax.random.normal(jax.random.PRNGKey(1), (V + 3, H))
    np.testing.assert_array_equal(np.asarray(embedding_rows(t, tokens, vocab_sharded=True)), np.asarray(t[tokens]))
    mesh = make_mesh((1, 8))
    with mesh_context(mesh):
        for tab, sharded in ((t, False), (odd, True)):
            jaxpr = jax.make_jaxpr(lambda a, i, s=sharded: embedding_rows(a, i, vocab_sharded=s))(tab, tokens)
            assert "shard_map" not in str(jaxpr)
            assert gather_operand_shapes(jaxpr.jaxpr) == [tab.shape]


def test_engine_programs_look_up_the_target_table_per_device():
    """The sharded engine's decode step and a K = 3 cycle (the draft embeds with the target's table): every lookup
    of the target's [V, H] table gathers from one device's rows."""
    cfg = pd.per_device_config(3, tiny=True)
    spec_cfg, dcfg = spec_configs(cfg, tiny=True)
    assert dcfg.vocab_size == cfg.vocab_size  # the draft has no table of its own: it reads the target's
    target = jax.eval_shape(lambda k: init_kimi_weights(cfg, k, jnp.bfloat16, experts="int4"), jax.random.key(0))
    draft = jax.eval_shape(lambda k: init_draft_weights(dcfg, k, jnp.bfloat16,
                                                        d2t=np.zeros(dcfg.draft_vocab_size, np.int32)),
                           jax.random.key(0))
    w = SpecWeights(jax.eval_shape(fuse_attention_inputs, target), draft)
    sp = SamplingParams().as_arrays()
    prompt = (jax.ShapeDtypeStruct((1, 16), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32), jax.random.key(0), sp)
    kw = dict(cfg=spec_cfg, capacity=64, greedy=True, max_new_tokens=8)
    base = jax.eval_shape(functools.partial(baseline_prefill, **kw), w, *prompt)
    spec = jax.eval_shape(functools.partial(spec_prefill, **kw, k=3, max_cycles=8), w, *prompt)
    v, h = cfg.vocab_size, cfg.hidden_size
    mesh = make_mesh((1, 8))
    with mesh_context(mesh):
        for fn, state in ((functools.partial(baseline_step, cfg=spec_cfg, greedy=True, max_new_tokens=8), base),
                          (functools.partial(speculative_cycle, cfg=spec_cfg, k=3, greedy=True, max_new_tokens=8),
                           spec)):
            shapes = gather_operand_shapes(jax.make_jaxpr(fn)(w, state, sp).jaxpr)
            assert (v, h) not in shapes
            assert (v // 8, h) in shapes
