"""Warm-up + cosine learning rate whose length is fixed by a step count or by a wall-clock budget.

With a budget, the schedule's total is set after timing a few steps (compilation excluded): the
warm-up does not depend on the total, so the steps taken while timing follow the final schedule.
"""

from __future__ import annotations

import time

import optax


class BudgetedSchedule:
    def __init__(self, peak_lr: float, warmup_steps: int, *, steps: int | None = None, seconds: float | None = None,
                 end_fraction: float = 0.1, timing_steps: int = 20):
        if (steps is None) == (seconds is None):
            raise ValueError("give exactly one of steps or seconds")
        self.peak_lr, self.warmup_steps, self.end_fraction = peak_lr, warmup_steps, end_fraction
        self.seconds, self.timing_steps = seconds, timing_steps
        self.total_steps: int | None = None
        self._fn = None
        self._t0: float | None = None
        self._timed_from: tuple[int, float] | None = None
        if steps is not None:
            self._fix(steps)

    def _fix(self, total: int) -> None:
        self.total_steps = max(int(total), 1)
        warmup = min(self.warmup_steps, max(self.total_steps // 10, 1))
        self._fn = optax.warmup_cosine_decay_schedule(
            0.0, self.peak_lr, warmup, max(self.total_steps, warmup + 1), self.peak_lr * self.end_fraction
        )

    def lr(self, step: int) -> float:
        if self._fn is None:  # timing phase: the warm-up ramp alone
            return self.peak_lr * min(1.0, (step + 1) / max(self.warmup_steps, 1))
        return float(self._fn(step))

    def start(self, seconds: float | None = None) -> None:
        """Call once the first (compiling) step has finished: the budget counts from here (`seconds`
        replaces the budget given at construction, e.g. what is left before a deadline)."""
        self._t0 = time.perf_counter()
        if seconds is not None and self.total_steps is None:
            self.seconds = max(seconds, 1.0)

    def observe(self, step_done: int, synced: bool) -> None:
        """After step `step_done` (1-based count of steps finished); `synced`: device work is complete."""
        if self.total_steps is not None or not synced or self._t0 is None:
            return
        if self._timed_from is None:
            self._timed_from = (step_done, time.perf_counter())
            return
        n0, t_from = self._timed_from
        if step_done - n0 >= self.timing_steps:
            now = time.perf_counter()
            per_step = (now - t_from) / (step_done - n0)
            left = self.seconds - (now - self._t0)
            self._fix(step_done + max(int(left / per_step), 1))

    def done(self, steps_done: int) -> bool:
        return self.total_steps is not None and steps_done >= self.total_steps
