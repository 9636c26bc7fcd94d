"""The training recipes on CPU: the training-time-test unroll against the engine's draft chain, and
tiny smoke runs of `train_target` and `train_draft` (including an orbax resume)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import train_draft, train_target
from jaxspec.training.artifacts import load_draft_dir, load_target_dir
from jaxspec.training.ttt import ttt_unroll
from model.eagle3 import DraftConfig, draft_forward, init_draft_cache
from model.init import init_draft_weights


def test_ttt_unroll_matches_draft_chain():
    """Step k of the unroll at index t == the engine's k-th chained draft_forward from root t."""
    cfg = DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                      vocab_size=50, draft_vocab_size=20, rope_theta=10000.0, rms_norm_eps=1e-6, aux_layer_ids=(0, 1, 2))
    rng = np.random.default_rng(0)
    layout = jax.eval_shape(lambda: init_draft_weights(cfg, jax.random.PRNGKey(0), jnp.float32, d2t=np.arange(20)))
    w = jax.tree_util.tree_map(  # numpy draws: compiling jax.random for every shape takes seconds on CPU
        lambda x: jnp.asarray(rng.standard_normal(x.shape) * x.shape[-1] ** -0.5, x.dtype), layout
    ).replace(d2t=jnp.arange(20, dtype=jnp.int32))
    b, t, steps = 2, 12, 4
    embed = jnp.asarray(rng.standard_normal((50, 32)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 50, (b, t)), jnp.int32)
    aux = jnp.asarray(rng.standard_normal((b, t, 96)), jnp.float32)
    unrolled = jax.jit(ttt_unroll, static_argnums=(1, 5))(w, cfg, embed, tokens, aux, steps)
    draft = jax.jit(draft_forward, static_argnums=1)
    # the extend over the whole window fills every slot; a chain from `root` overwrites slots root+1.. in
    # order before any of its queries can see them, exactly as the engine's stale slots are
    extend = draft(w, cfg, embed, None, jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))), aux,
                   jnp.broadcast_to(jnp.arange(t), (b, t)), init_draft_cache(cfg, b, t + steps, jnp.float32))
    for root in range(t - 1):
        np.testing.assert_allclose(extend.logits[:, root], unrolled[0][:, root], atol=1e-4)
        h, cache = extend.hidden[:, root : root + 1], extend.cache
        for k in range(1, steps):
            if root + k + 1 >= t:
                break
            out = draft(w, cfg, embed, None, tokens[:, root + k + 1 : root + k + 2], h, jnp.full((b, 1), root + k), cache)
            np.testing.assert_allclose(out.logits[:, 0], unrolled[k][:, root], atol=1e-4)
            h, cache = out.hidden, out.cache


SMOKE_DATA = ["--max-files", "24", "--held-out-percent", "25", "--val-percent", "20", "--seq-len", "64", "--batch", "8"]


def test_smoke_train_target_then_draft_with_resume(tmp_path):
    target_report = train_target.main([
        "--preset", "smoke", "--out", str(tmp_path), "--vocab-size", "320", "--steps", "12", "--warmup", "3",
        "--eval-every", "12", "--eval-windows", "16", "--final-eval-windows", "16", "--log-every", "6", *SMOKE_DATA,
    ])
    curves = target_report["curves"]
    assert len(curves["train_loss"]) == 12 and curves["train_loss"][-1] < curves["train_loss"][0]
    assert np.isfinite(target_report["held_out"]["ppl_int4_experts"])
    assert target_report["held_out"]["independent_of_step_choice"] is True  # SMOKE_DATA keeps validation files
    cfg, w = load_target_dir(tmp_path / "target")  # config.json parses as DeepseekV3 with INT4 experts
    assert cfg.quant is not None and cfg.quant.method == "int4" and cfg.eagle_aux_layers == (0, 1, 2)

    draft_args = [
        "--preset", "smoke", "--target", str(tmp_path / "target"), "--tokenizer", str(tmp_path / "tokenizer.json"),
        "--out", str(tmp_path / "draft"), "--steps", "8", "--warmup", "2", "--ttt-steps", "3", "--eval-depth", "3",
        "--rollouts", "8", "--rollout-batch", "8", "--prompt-len", "16", "--eval-prompts", "8", "--eval-every", "8",
        "--log-every", "4", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "4", *SMOKE_DATA,
    ]
    report = train_draft.main(draft_args)
    accept = report["held_out"]["chain_acceptance_by_depth"]
    assert len(accept) == 3 and all(0.0 <= a <= 1.0 for a in accept)
    assert accept == sorted(accept, reverse=True)  # a chain cannot get longer at depth k+1 than at k
    dcfg, dw = load_draft_dir(tmp_path / "draft")
    assert dcfg.draft_vocab_size == dw.lm_head.shape[0] and dw.d2t is not None
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]

    # resume: drop the last checkpoint, rerun, land on the same weights
    first = {k: np.asarray(v, np.float32) for k, v in np.load(tmp_path / "draft" / "weights-00000.npz").items()}
    shutil.rmtree(tmp_path / "ckpt" / "8")
    shutil.rmtree(tmp_path / "draft")  # training never overwrites an output directory
    train_draft.main(draft_args)
    again = np.load(tmp_path / "draft" / "weights-00000.npz")
    for k, v in first.items():
        np.testing.assert_array_equal(np.asarray(again[k], np.float32), v, err_msg=k)


def test_a_diverged_target_run_ships_nothing(tmp_path):
    """A learning rate that sends the loss to NaN: the run ends with one line saying so, and writes no tokenizer,
    weights or metrics that would pass for a model (NaN weights, a metrics file holding NaN)."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="training diverged"):
        train_target.main(["--preset", "smoke", "--out", str(out), "--vocab-size", "320", "--steps", "2", "--warmup",
                           "0", "--eval-every", "2", "--eval-windows", "4", "--final-eval-windows", "4", "--lr", "1e30",
                           *SMOKE_DATA])
    assert not out.exists()
