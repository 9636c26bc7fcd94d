"""The draft's training step: the target (frozen) gives aux states and next-token distributions, the
draft unrolls `steps` positions (training-time test), and each step's cross-entropy against the target's
distribution over the draft vocabulary is weighted 0.8**k (EAGLE-3 / SpecForge)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxspec.training.casting import compute_copy
from jaxspec.training.optimizer import AdamWSpec, global_norm, with_learning_rate
from jaxspec.training.target_step import run_target
from jaxspec.training.ttt import shift_left, ttt_unroll
from model.config import TextConfig
from model.decoder import KimiWeights
from model.eagle3 import DraftConfig, DraftWeights

STEP_DECAY = 0.8


class DraftState(NamedTuple):
    weights: DraftWeights  # float32 masters; d2t stays None here (integers get no gradient)
    opt_state: optax.OptState


class TargetView(NamedTuple):
    """What the draft learns from, at every position: aux states, target distribution, target argmax."""

    aux_BTA: jax.Array
    logits_BTV: jax.Array  # float32 over the full target vocabulary
    argmax_BT: jax.Array


def target_view(target_w: KimiWeights, cfg: TextConfig, tokens_BT, dtype) -> TargetView:
    out = run_target(target_w, cfg, tokens_BT, dtype)
    logits = jax.lax.stop_gradient(out.logits)
    return TargetView(jax.lax.stop_gradient(out.aux_hidden), logits, jnp.argmax(logits, -1).astype(jnp.int32))


def chain_losses_and_matches(draft_logits, view: TargetView, draft_ids_Y, in_draft_vocab_V):
    """Per step k: (mean soft cross-entropy, valid mask [B, T], match [B, T]) for the prediction at index t
    of the target's token at t+k+2, i.e. the target's distribution at t+k+1."""
    t = view.argmax_BT.shape[1]
    p_BTY = jax.nn.softmax(view.logits_BTV[..., draft_ids_Y], axis=-1)
    losses, valids, matches = [], [], []
    for k, logits_BTY in enumerate(draft_logits):
        want_BT = shift_left(view.argmax_BT, k + 1)
        inside_BT = jnp.arange(t)[None, :] + k + 1 <= t - 1
        # positions whose target argmax the draft vocabulary cannot emit teach nothing (SpecForge masks them)
        valid_BT = inside_BT & in_draft_vocab_V[want_BT]
        ce_BT = -(shift_left(p_BTY, k + 1) * jax.nn.log_softmax(logits_BTY, -1)).sum(-1)
        losses.append((ce_BT * valid_BT).sum() / jnp.maximum(valid_BT.sum(), 1))
        valids.append(inside_BT)
        matches.append((draft_ids_Y[jnp.argmax(logits_BTY, -1)] == want_BT) & inside_BT)
    return losses, valids, matches


def chain_acceptance(matches, valids, root_mask_BT):
    """Per depth k: fraction of chain roots whose drafts 0..k all equal the target's greedy tokens
    (roots where the whole chain fits in the window and `root_mask` holds)."""
    roots = root_mask_BT & valids[-1]
    alive = roots
    acc = []
    for m in matches:
        alive = alive & m
        acc.append(alive.sum() / jnp.maximum(roots.sum(), 1))
    return jnp.stack(acc), roots.sum()


def _draft_loss(draft_w, view, cfg: DraftConfig, embed, tokens_BT, draft_ids_Y, in_vocab_V, steps, dtype):
    logits = ttt_unroll(compute_copy(draft_w, dtype), cfg, embed, tokens_BT, view.aux_BTA, steps)
    losses, valids, matches = chain_losses_and_matches(logits, view, draft_ids_Y, in_vocab_V)
    total = sum(STEP_DECAY**k * l for k, l in enumerate(losses))
    return total, (jnp.stack(losses), valids, matches)


@functools.partial(jax.jit, static_argnames=("cfg", "target_cfg", "opt", "steps", "dtype"), donate_argnums=(0,))
def draft_train_step(state: DraftState, target_w, tokens_BT, root_mask_BT, draft_ids_Y, in_vocab_V, lr, *,
                     cfg: DraftConfig, target_cfg: TextConfig, opt: AdamWSpec, steps: int, dtype=jnp.bfloat16):
    tx = opt.build(state.weights)
    view = target_view(target_w, target_cfg, tokens_BT, dtype)
    grad_fn = jax.value_and_grad(_draft_loss, has_aux=True)
    (loss, (step_losses, valids, matches)), grads = grad_fn(
        state.weights, view, cfg, target_w.embed, tokens_BT, draft_ids_Y, in_vocab_V, steps, dtype
    )
    opt_state = with_learning_rate(state.opt_state, lr)
    updates, opt_state = tx.update(grads, opt_state, state.weights)
    weights = optax.apply_updates(state.weights, updates)
    accept, _ = chain_acceptance(matches, valids, root_mask_BT)
    metrics = {"loss": loss, "step_losses": step_losses, "accept": accept, "grad_norm": global_norm(grads)}
    return DraftState(weights, opt_state), metrics


@functools.partial(jax.jit, static_argnames=("cfg", "target_cfg", "steps", "dtype"))
def draft_eval(draft_w, target_w, tokens_BT, root_mask_BT, draft_ids_Y, in_vocab_V, *,
               cfg: DraftConfig, target_cfg: TextConfig, steps: int, dtype=jnp.bfloat16):
    """(loss, per-depth chain acceptance [steps], number of roots) on one batch."""
    view = target_view(target_w, target_cfg, tokens_BT, dtype)
    loss, (_, valids, matches) = _draft_loss(draft_w, view, cfg, target_w.embed, tokens_BT, draft_ids_Y, in_vocab_V,
                                             steps, dtype)
    accept, roots = chain_acceptance(matches, valids, root_mask_BT)
    return loss, accept, roots
