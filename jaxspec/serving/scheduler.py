"""Requests in, tokens out: a bounded queue in front of the slots, and the one thread that drives the device.

The engine thread loops: end the slots whose requests were cancelled, prefill waiting requests into free slots,
run a few cycles over all slots, hand each request its new tokens, free the slots that finished. A prompt longer
than the prefill chunk is admitted one chunk per loop into a slot it holds meanwhile, so the running slots keep
emitting while it is admitted (one such admission at a time, in arrival order). Nothing a request does (a failed
prefill, a client that disconnects) stops the loop; a failed step fails the requests in flight and starts the
slots afresh.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import sys
import threading
import time
from typing import Callable

import numpy as np

from jaxspec.sampling import SamplingParams
from jaxspec.serving.metrics import Metrics
from jaxspec.serving.slot_engine import Admission, SlotEngine

log = logging.getLogger("jaxspec.serve")
IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps between checks for stop (woken at once by work)
# The engine thread waits for each device loop with the GIL released; when the loop is done it must win the GIL back
# from the HTTP threads, which Python's default lets hold it up to 5 ms, longer than a small model's loop takes: the
# loop times the adaptive rule weighs then carry a long tail of those threads' time. A short interval bounds the
# wait (docs/performance.md, "Adaptive K in the server").
GIL_SWITCH_INTERVAL_S = 0.0005


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Tokens:
    ids: list[int]


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (EOS) or "length"


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str


@dataclasses.dataclass(eq=False)
class Request:
    """`deliver` is called from the engine thread with Tokens, then one Finished or Failed."""
    tokens: list[int]
    max_new: int
    sampling: SamplingParams
    seed: int
    deliver: Callable[[object], None]
    id: int = dataclasses.field(default_factory=itertools.count().__next__)
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    generated: list[int] = dataclasses.field(default_factory=list)  # tokens delivered so far

    # A preempted request resumes as a new prompt: its own and the tokens it emitted, asking what is left.
    @property
    def context(self) -> list[int]:
        return self.tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.generated)

    @property
    def admission_seed(self) -> int:
        """The seed of this admission: a resumed request draws afresh rather than replay its first draws at later
        positions."""
        return self.seed if not self.generated else hash((self.seed, len(self.generated))) % 2**31


class Scheduler:
    def __init__(self, engine: SlotEngine, metrics: Metrics, max_queue: int):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.eos_ids = frozenset(engine.cfg.eos_ids)
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: dict[int, Request] = {}  # slot -> request
        self._admitting: tuple[int, Request, Admission] | None = None  # a long prompt's slot, request, progress
        # slots freed on the host (cancelled, preempted) that the device still computes as live until a step ends
        # them: kept until a step runs, since a loop that frees the last running request runs no step
        self._to_end: set[int] = set()
        self._wake = threading.Condition()
        self._stopping = False
        self._deadline = float("inf")  # when stopping: in-flight requests still running then are ended
        self._said_not_paying = False  # the log's line that speculation does not pay, said once
        self._said_off = False  # an adaptive server's line that it runs plain steps, said when it goes plain
        self._thread = threading.Thread(target=self._run, name="jaxspec-engine", daemon=True)

    # --- called from the server's threads ------------------------------------------------------------
    def start(self) -> None:
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:  # process-wide: only ever shortened
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                # requests whose clients gave up hold no place, even while the engine thread is busy (a long
                # prefill) and has not dropped them yet
                self._forget_cancelled_waiting()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (the limit is {self.max_queue})")
            self._waiting.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """End `request` (client gone, stop string seen): its slot is freed before the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def stop(self, timeout_s: float) -> None:
        """Refuse new requests, let those in flight finish for up to `timeout_s`, end the rest, join the thread."""
        with self._wake:
            self._stopping = True
            self._deadline = time.monotonic() + timeout_s
            self._wake.notify()
        self._thread.join()

    # --- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stopping and (time.monotonic() >= self._deadline
                                       or not (self._waiting or self._active or self._admitting)):
                    break
                if not self._waiting and not self._active and self._admitting is None:
                    self._wake.wait(IDLE_WAIT_S)
                    continue
            self._to_end.update(self._drop_cancelled())
            self._admit()
            self._admit_next_chunk()
            self._report_occupancy()
            if not self._active:
                continue
            self._to_end.update(self._preempt())
            cancel = np.zeros(self.engine.max_batch, bool)
            cancel[[s for s in self._to_end if s not in self._active]] = True  # a slot reused since is live again
            self._to_end.clear()
            self._step(cancel)
            self._report_occupancy()
        self._end_all("the server shut down before the request finished")

    def _forget_cancelled_waiting(self) -> None:
        """The waiting requests less the cancelled ones (the caller holds `_wake`)."""
        kept = [r for r in self._waiting if not r.cancelled]
        self._waiting.clear()
        self._waiting.extend(kept)

    def _drop_cancelled(self) -> list[int]:
        """Forget cancelled requests (waiting ones too, so they stop counting against the queue's bound); returns
        the slots they held."""
        with self._wake:
            self._forget_cancelled_waiting()
        freed = [slot for slot, r in self._active.items() if r.cancelled]
        for slot in freed:
            del self._active[slot]
        self.engine.free_slots(freed)
        return freed

    def _admit(self) -> None:
        held = None if self._admitting is None else self._admitting[0]
        free = [s for s in range(self.engine.max_batch) if s not in self._active and s != held]
        while free:
            with self._wake:
                if not self._waiting:
                    return
                request = self._waiting.popleft()
                if self.engine.admits_in_chunks(request.context) and self._admitting is not None:
                    self._waiting.appendleft(request)  # one long prompt at a time, in arrival order
                    return
                if not request.cancelled and not self.engine.has_room(len(request.context), request.remaining):
                    self._waiting.appendleft(request)  # in arrival order, once ended requests give pages back
                    return
            if request.cancelled:
                continue
            slot = free[0]
            if self.engine.admits_in_chunks(request.context):
                try:
                    self._admitting = (slot, request, self.engine.begin_admission(
                        request.context, request.sampling, request.admission_seed, request.remaining))
                except Exception as e:  # noqa: BLE001 - one request's failure must not stop the server
                    self._prefill_failed(request, e)
                    continue
                free.pop(0)
                continue
            try:
                first, done = self.engine.prefill(slot, request.context, request.remaining, request.sampling,
                                                  request.admission_seed)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the server
                self._prefill_failed(request, e)
                continue
            if self._started(slot, request, first, done):
                free.pop(0)

    def _admit_next_chunk(self) -> None:
        """One chunk of the prompt being admitted; once all are in, its first token and its slot."""
        if self._admitting is None:
            return
        slot, request, admission = self._admitting
        if request.cancelled:
            self._admitting = None
            self.engine.release_admission(admission)
            return
        try:
            self.engine.admit_chunk(admission)
            if not admission.prefilled:
                return
            self._admitting = None
            first, done = self.engine.finish_admission(slot, admission, request.remaining)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the server
            self._admitting = None
            self.engine.release_admission(admission)
            self._prefill_failed(request, e)
            return
        self._started(slot, request, first, done)

    def _preempt(self) -> list[int]:
        """Make room in a paged cache for the running requests' next device loop: a prompt being admitted a chunk at a
        time, then the most recently admitted requests, give their pages back and wait at the head of the queue to
        resume (their clients see only a pause). Returns the preempted slots, to be ended in the next step."""
        if self._admitting is not None and self.engine.pages_short():  # the latest comer gives way first
            _, request, admission = self._admitting
            self._admitting = None
            self.engine.release_admission(admission)
            with self._wake:
                self._waiting.appendleft(request)
            self.metrics.preempted(1)
        victims = self.engine.slots_to_preempt()
        if not victims:
            return []
        self.engine.free_slots(victims)
        with self._wake:
            for slot in sorted(victims, key=lambda s: self._active[s].submitted, reverse=True):
                self._waiting.appendleft(self._active.pop(slot))
        self.metrics.preempted(len(victims))
        log.info("preempted %d request(s): the cache's pages are short for the running ones", len(victims))
        return victims

    def _prefill_failed(self, request: Request, e: Exception) -> None:
        log.exception("prefill failed")
        request.deliver(Failed(f"prefill failed: {e.__class__.__name__}: {e}"))

    def _started(self, slot: int, request: Request, first: int, done: bool) -> bool:
        """Hand a prefilled request its first token (a resumed one: its next); whether it now runs in `slot`."""
        if not request.generated:
            self.metrics.prompt(len(request.tokens))
        self.metrics.step(1, 0, 0, 0)
        request.generated.append(first)
        request.deliver(Tokens([first]))
        if done:
            request.deliver(Finished(self._reason(first)))
            self.engine.free_slots([slot])
            return False
        self._active[slot] = request
        return True

    def _step(self, cancel: np.ndarray) -> None:
        any_sampled = any(not r.sampling.greedy for r in self._active.values())
        try:
            result = self.engine.step(cancel, any_sampled)
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
            log.exception("device step failed")
            self._end_all(f"generation failed: {e.__class__.__name__}: {e}")
            self.engine.reset()
            return
        emitted, ended = 0, []
        for slot, request in list(self._active.items()):
            new = result.tokens[slot]
            emitted += len(new)
            if new:
                request.generated.extend(new)
                request.deliver(Tokens(new))
            if result.done[slot]:
                del self._active[slot]
                ended.append(slot)
                last = new[-1] if new else None
                request.deliver(Finished(self._reason(last)))
        self.engine.free_slots(ended)
        self.metrics.step(emitted, result.cycles, result.accepted, result.slot_cycles)
        if not self._said_not_paying and result.k > 0:
            line = self.metrics.speculation_not_paying()
            if line:
                log.warning(line)
                self._said_not_paying = True
        policy = getattr(self.engine, "choose_k", None)
        if hasattr(policy, "report"):  # an adaptive server: its figures on /metrics, and a line when it goes plain
            report = policy.report()
            self.metrics.speculation(report)
            line = policy.verdict(report)
            if line and not self._said_off:
                log.warning(line)
            self._said_off = line is not None

    def _reason(self, last_token) -> str:
        return "stop" if last_token in self.eos_ids else "length"

    def _end_all(self, message: str) -> None:
        with self._wake:
            ended = list(self._active.values()) + list(self._waiting)
            try:
                self.engine.free_slots(list(self._active))
            except Exception:  # noqa: BLE001 - after a failed step the state may be gone; the engine is reset then
                log.exception("freeing the slots' cache pages failed")
            if self._admitting is not None:
                ended.append(self._admitting[1])
                self.engine.release_admission(self._admitting[2])
            self._active.clear()
            self._waiting.clear()
            self._admitting = None
        for request in ended:
            request.deliver(Failed(message))
        self._report_occupancy()

    def _report_occupancy(self) -> None:
        self.metrics.occupancy(len(self._waiting), len(self._active))
        self.metrics.prefix_cache(self.engine.prefix.stats())
        if getattr(self.engine, "cache_pages", None) is not None:
            self.metrics.cache_pages(self.engine.cache_pages - self.engine.cache_pages_free, self.engine.cache_pages,
                                     self.engine.cache_tokens_held)
