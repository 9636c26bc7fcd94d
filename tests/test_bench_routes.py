"""bench.routes: the routing regimes bench times kernels under (issue 36), handed to the forward as data, and that
the model's own router is what runs when no regime is set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.routes import ROUTINGS, regime_ids
from bench.step import bench_config, draw_weights, make_step, random_cache, step_inputs
from model.config import Kernels
from model.decoder import forward


def _unique_per_row(ids, rows, tokens):
    return np.array([len(set(r.ravel())) for r in np.asarray(ids).reshape(rows, tokens, -1)])


def test_regimes_choose_distinct_experts_with_the_sharing_they_name():
    rows, tokens, experts, k = 400, 4, 384, 8
    key = jax.random.PRNGKey(3)
    by = {r: regime_ids(key, rows, tokens, experts, k, r) for r in ROUTINGS[1:]}
    for name, ids in by.items():
        ids = np.asarray(ids)
        assert ids.shape == (rows * tokens, k) and ids.dtype == np.int32, name
        assert ids.min() >= 0 and ids.max() < experts, name
        assert all(len(set(t)) == k for t in ids), f"{name}: a token chose one expert twice"
    shared = np.asarray(by["shared"]).reshape(rows, tokens, k)
    assert (shared == shared[:, :1]).all()
    assert len({tuple(sorted(r[0])) for r in shared}) > rows // 2  # rows draw their own experts
    # 4 tokens: ~1 + 3 x 7.8/8 sets of experts at random, 1 + 3 x (1 - share) = 2.5 sets for neighbours, 1 shared
    mean = {name: _unique_per_row(ids, rows, tokens).mean() / k for name, ids in by.items()}
    assert mean["shared"] == 1.0
    assert 3.8 < mean["independent"] <= 4.0
    assert 2.3 < mean["neighbour"] < 2.7
    with pytest.raises(ValueError, match="routing must be one of"):
        regime_ids(key, 1, 1, experts, k, "model")


def test_the_step_routes_by_the_regime_or_by_its_router():
    cfg = bench_config(3, tiny=True)
    w = draw_weights(cfg, tiny=True)
    batch, tokens, context = 2, 4, 16
    key = jax.random.PRNGKey(0)

    def recorded(routing):
        cache = random_cache(cfg, batch, 32, context, key, jnp.float32)
        tokens_BT, positions_BT = step_inputs(cfg, batch, tokens, context, key)
        _, _, ids_LTK = make_step(cfg, Kernels(moe="off"), routing)(w, tokens_BT, positions_BT, cache)
        return np.asarray(ids_LTK)

    model_ids, shared_ids = recorded("model"), recorded("shared")
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert model_ids.shape == shared_ids.shape == (moe_layers, batch * tokens, cfg.num_experts_per_tok)
    for layer in range(moe_layers):  # each MoE layer its own draw, the draw regime_routes documents
        want = regime_ids(jax.random.fold_in(jax.random.PRNGKey(0), layer), batch, tokens, cfg.n_routed_experts,
                          cfg.num_experts_per_tok, "shared")
        np.testing.assert_array_equal(shared_ids[layer], np.asarray(want))
    assert not np.array_equal(model_ids, shared_ids)
    # "model": the router's own choices, as the same jitted forward makes them with nothing set; handing those
    # choices back in runs the same step, and the shared regime's choices run another
    cfg_off = cfg.replace(kernels=Kernels(moe="off"))
    run = jax.jit(lambda w, t, p, c, ids: forward(w, cfg_off, t, p, c, expert_ids=ids))
    inputs = step_inputs(cfg, batch, tokens, context, key)
    plain = run(w, *inputs, random_cache(cfg, batch, 32, context, key, jnp.float32), None)
    np.testing.assert_array_equal(model_ids, np.asarray(jnp.stack(plain.expert_ids)))
    again = run(w, *inputs, random_cache(cfg, batch, 32, context, key, jnp.float32), tuple(jnp.asarray(model_ids)))
    np.testing.assert_array_equal(np.asarray(again.logits), np.asarray(plain.logits))
    forced = run(w, *inputs, random_cache(cfg, batch, 32, context, key, jnp.float32), tuple(jnp.asarray(shared_ids)))
    np.testing.assert_array_equal(np.asarray(jnp.stack(forced.expert_ids)), shared_ids)
    assert not np.allclose(np.asarray(forced.logits), np.asarray(plain.logits))
