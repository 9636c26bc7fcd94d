"""Orbax checkpoints of the draft's training state (weights, optimizer, step, curves) for resuming."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp


class DraftCheckpoints:
    def __init__(self, directory: str | Path, keep: int = 2):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, curves: dict, total_steps: int | None) -> None:
        meta = {"curves": curves, "total_steps": total_steps}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def restore(self, template_state):
        """-> (step, state, curves, total_steps) from the latest checkpoint, shaped like `template_state`."""
        step = self.manager.latest_step()
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template_state)
        got = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        meta = got["meta"]
        # orbax hands back arrays committed to a device, a fresh state's are not, and jit keys its cache on that:
        # a run resumed in the same process compiled the training step and the evaluation a second time
        state = jax.tree_util.tree_map(lambda a: jax.device_put(np.asarray(a)), got["state"])
        return step, state, meta.get("curves"), meta.get("total_steps")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
