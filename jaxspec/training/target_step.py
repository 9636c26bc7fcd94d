"""The target's training step: next-token cross-entropy through model.decoder.forward (fresh cache of
capacity T, positions 0..T-1), AdamW, then the router-bias rebalancing."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxspec.training.casting import compute_copy
from jaxspec.training.optimizer import AdamWSpec, global_norm, with_learning_rate
from jaxspec.training.router_balance import expert_loads, load_imbalance, rebalance_biases
from model.config import TextConfig
from model.decoder import KimiWeights, forward
from model.kv_cache import init_latent_cache


class TargetState(NamedTuple):
    weights: KimiWeights  # float32 masters
    opt_state: optax.OptState


def tapping_config(cfg: TextConfig) -> TextConfig:
    """The same model, with every layer's output reported as aux_hidden (for the router loads)."""
    return cfg.replace(aux_layer_ids=tuple(range(cfg.num_hidden_layers)))


def run_target(w: KimiWeights, cfg: TextConfig, tokens_BT, dtype=jnp.bfloat16):
    """A training-style full-sequence forward: fresh cache of capacity T, positions arange(T)."""
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return forward(w, cfg, tokens_BT, positions_BT, init_latent_cache(cfg, b, t, dtype))


def next_token_nll(logits_BTV, tokens_BT):
    """[B, T-1] negative log-likelihood of token t+1 given logits at t."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV[:, :-1], tokens_BT[:, 1:])


def _loss(weights, cfg_tap, tokens_BT, dtype):
    out = run_target(compute_copy(weights, dtype), cfg_tap, tokens_BT, dtype)
    return next_token_nll(out.logits, tokens_BT).mean(), out.aux_hidden


@functools.partial(jax.jit, static_argnames=("cfg", "opt", "gamma", "dtype"), donate_argnums=(0,))
def train_step(state: TargetState, tokens_BT, lr, *, cfg: TextConfig, opt: AdamWSpec, gamma: float, dtype=jnp.bfloat16):
    tx = opt.build(state.weights)
    cfg_tap = tapping_config(cfg)
    (loss, layer_outputs), grads = jax.value_and_grad(_loss, has_aux=True)(state.weights, cfg_tap, tokens_BT, dtype)
    opt_state = with_learning_rate(state.opt_state, lr)
    updates, opt_state = tx.update(grads, opt_state, state.weights)
    weights = optax.apply_updates(state.weights, updates)
    # router_bias gets no gradient (it only chooses experts) and is masked from decay: only this moves it
    loads = expert_loads(compute_copy(jax.lax.stop_gradient(state.weights), dtype), cfg, tokens_BT,
                         jax.lax.stop_gradient(layer_outputs))
    weights = rebalance_biases(weights, loads, gamma)
    metrics = {"loss": loss, "grad_norm": global_norm(grads), "imbalance": load_imbalance(loads)}
    return TargetState(weights, opt_state), metrics


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def eval_nll_sum(weights, tokens_BT, *, cfg: TextConfig, dtype=jnp.bfloat16):
    """(sum of next-token NLL, number of predicted tokens) over a batch of windows."""
    out = run_target(compute_copy(weights, dtype), cfg, tokens_BT, dtype)
    nll = next_token_nll(out.logits, tokens_BT)
    return nll.sum(), jnp.asarray(nll.size, jnp.float32)
