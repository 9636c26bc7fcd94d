"""Orbax checkpoints of the draft's training state (weights, optimizer, step, curves) for resuming."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxspec.cli_common import UsageError


class DraftCheckpoints:
    """`run_key` (JSON) names what makes two runs one: a checkpoint saved under another key is not resumed."""

    def __init__(self, directory: str | Path, keep: int = 2, run_key: dict | None = None):
        self.directory, self.run_key = directory, run_key
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, curves: dict, total_steps: int | None) -> None:
        meta = {"curves": curves, "total_steps": total_steps, "run_key": self.run_key}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def restore(self, template_state):
        """-> (step, state, curves, total_steps) from the latest checkpoint, shaped like `template_state`."""
        step = self.manager.latest_step()
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        saved_key = meta.get("run_key")
        # checkpoints without a key predate it; with another draft vocabulary, the same shapes would resume
        # silently into weights whose lm_head rows stand for other tokens
        if saved_key is not None and self.run_key is not None and saved_key != self.run_key:
            raise UsageError(f"--ckpt-dir {self.directory}: checkpoints of another run (another draft vocabulary: "
                             f"other --target, --tokenizer, corpus or --draft-vocab-size); give a new --ckpt-dir")
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template_state)
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        except ValueError as e:  # orbax: a stored shape other than this run's
            raise UsageError(f"--ckpt-dir {self.directory}: checkpoints of a run with other shapes (other --preset, "
                             f"--target or --draft-vocab-size): {str(e).splitlines()[0]}") from None
        # orbax hands back arrays committed to a device, a fresh state's are not, and jit keys its cache on that:
        # a run resumed in the same process compiled the training step and the evaluation a second time
        state = jax.tree_util.tree_map(lambda a: jax.device_put(np.asarray(a)), got["state"])
        return step, state, meta.get("curves"), meta.get("total_steps")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
