"""The server's counters and gauges, rendered in the Prometheus text exposition format."""

from __future__ import annotations

import collections
import threading
import time

from jaxspec.serving.assistant_output import MALFORMED_KINDS

TOKENS_PER_S_WINDOW_S = 10.0  # tokens per second is measured over this trailing window
# slot-cycles with not one draft accepted before the server says speculation does not pay: with none accepted each
# cycle yields the one token a plain step yields, and drafting and verifying cost more than that step
NEVER_ACCEPTED_MIN_SLOT_CYCLES = 64


def _number(value) -> str:
    return "NaN" if value != value else repr(value)  # Prometheus spells not-a-number NaN


class Metrics:
    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self.requests = collections.Counter()  # outcome -> count
        self.malformed_tool_calls = collections.Counter()  # what was wrong -> count (returned as content)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.queue_length = 0
        self.active_slots = 0
        self.cycles = 0
        self.accepted_drafts = 0
        self.slot_cycles = 0
        self._recent = collections.deque()  # (time, tokens) of recent steps
        self._prefix: dict[str, int] = {}  # the prefix cache's counts (PrefixIndex.stats)
        self._cache_pages: tuple[int, int, int] | None = None  # a paged cache's (pages in use, pages, tokens held)
        self.preemptions = 0
        self._speculation: dict | None = None  # an adaptive server's figures (BatchAdaptiveK.report)

    def request_done(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def malformed(self, kinds: list[str]) -> None:
        with self._lock:
            self.malformed_tool_calls.update(kinds)

    def prompt(self, tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += tokens

    def step(self, tokens: int, cycles: int, accepted: int, slot_cycles: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.generation_tokens += tokens
            self.cycles += cycles
            self.accepted_drafts += accepted
            self.slot_cycles += slot_cycles
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW_S:
                self._recent.popleft()

    def occupancy(self, queued: int, active: int) -> None:
        with self._lock:
            self.queue_length, self.active_slots = queued, active

    def cache_pages(self, in_use: int, total: int, tokens_held: int) -> None:
        with self._lock:
            self._cache_pages = (in_use, total, tokens_held)

    def preempted(self, requests: int) -> None:
        with self._lock:
            self.preemptions += requests

    def speculation(self, report: dict) -> None:
        with self._lock:
            self._speculation = report

    def prefix_cache(self, stats: dict[str, int]) -> None:
        with self._lock:
            self._prefix = dict(stats)

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [n for t, n in self._recent if t >= now - TOKENS_PER_S_WINDOW_S]
        return sum(recent) / TOKENS_PER_S_WINDOW_S

    def speculation_not_paying(self) -> str | None:
        """One line for the user when the drafter has not had one draft accepted in many slot-cycles; None
        otherwise (acceptance alone, without the cost of a cycle in plain steps, decides nothing else)."""
        with self._lock:
            if self.accepted_drafts or self.slot_cycles < NEVER_ACCEPTED_MIN_SLOT_CYCLES:
                return None
            n = self.slot_cycles
        return (f"speculation does not pay: no draft was accepted in {n} slot-cycles (mean acceptance length 1.00), "
                "so each cycle yields the one token a plain step yields at the cost of drafting and verifying; the "
                "drafter does not match this target: serve with --speculative-num-steps 0")

    def mean_acceptance_length(self) -> float:
        """Tokens per slot-cycle (accepted drafts + the target's own token); NaN before any cycle."""
        with self._lock:
            return (self.accepted_drafts + self.slot_cycles) / self.slot_cycles if self.slot_cycles else float("nan")

    def render(self) -> str:
        tps, mal = self.tokens_per_s(), self.mean_acceptance_length()
        with self._lock:
            rows = [
                ("jaxspec_requests_total", "counter", "Requests by outcome",
                 [({"outcome": o}, n) for o, n in sorted(self.requests.items())] or [({"outcome": "completed"}, 0)]),
                ("jaxspec_malformed_tool_calls_total", "counter",
                 "Tool calls (or sections) in model output that could not be parsed and were returned as content",
                 [({"kind": k}, self.malformed_tool_calls[k]) for k in MALFORMED_KINDS]),
                ("jaxspec_prompt_tokens_total", "counter", "Prompt tokens prefilled", [({}, self.prompt_tokens)]),
                ("jaxspec_generation_tokens_total", "counter", "Tokens generated", [({}, self.generation_tokens)]),
                ("jaxspec_queue_length", "gauge", "Requests waiting for a slot", [({}, self.queue_length)]),
                ("jaxspec_active_slots", "gauge", "Slots holding a request", [({}, self.active_slots)]),
                ("jaxspec_batch_occupancy", "gauge", "Active slots / slots",
                 [({}, self.active_slots / self.max_batch)]),
                ("jaxspec_mean_acceptance_length", "gauge", "Tokens per slot-cycle since start (accepted drafts + 1)",
                 [({}, mal)]),
                ("jaxspec_cycles_total", "counter", "Device cycles run", [({}, self.cycles)]),
                ("jaxspec_slot_cycles_total", "counter", "Live slots summed over the cycles run",
                 [({}, self.slot_cycles)]),
                ("jaxspec_drafts_accepted_total", "counter", "Draft tokens accepted", [({}, self.accepted_drafts)]),
                ("jaxspec_speculation_not_paying", "gauge", "1 once no draft was accepted in "
                 f"{NEVER_ACCEPTED_MIN_SLOT_CYCLES} or more slot-cycles (the server logs why)",
                 [({}, int(not self.accepted_drafts and self.slot_cycles >= NEVER_ACCEPTED_MIN_SLOT_CYCLES))]),
                ("jaxspec_tokens_per_second", "gauge",
                 f"Tokens generated per second over the last {TOKENS_PER_S_WINDOW_S:g} s", [({}, tps)]),
            ]
            if self._cache_pages is not None:
                rows += [("jaxspec_cache_pages_in_use", "gauge", "Pages of the paged cache held by requests",
                          [({}, self._cache_pages[0])]),
                         ("jaxspec_cache_pages", "gauge", "Pages of the paged cache", [({}, self._cache_pages[1])]),
                         ("jaxspec_cache_tokens_held", "gauge", "Tokens the running requests' sequences hold",
                          [({}, self._cache_pages[2])]),
                         ("jaxspec_preemptions_total", "counter", "Requests preempted for pages (each resumed later)",
                          [({}, self.preemptions)])]
            a = self._speculation
            if a is not None:
                rows += [("jaxspec_speculation_k", "gauge", "Drafts per cycle the adaptive rule chose for the next "
                          "loop (0: plain steps)", [({}, a["k"])]),
                         ("jaxspec_speculation_loops_total", "counter", "Device loops run per K",
                          [({"k": k}, n) for k, n in sorted(a["loops"].items())]),
                         ("jaxspec_draft_acceptance_estimate", "gauge", "Estimated conditional acceptance of each "
                          "draft position (recent loops, decayed)",
                          [({"position": j + 1}, c) for j, c in enumerate(a["acceptance"])]),
                         ("jaxspec_expected_tokens_per_slot_cycle", "gauge", "Tokens a slot-cycle of K yields at the "
                          "estimated acceptance", [({"k": k}, e) for k, e in sorted(a["expected_tokens"].items())]),
                         ("jaxspec_cycle_cost_plain_steps", "gauge", "A cycle of K in plain steps at the current "
                          "occupancy (measured here)", [({"k": k}, c) for k, c in
                                                        sorted(a["cycle_plain_steps"].items())])]
            p = self._prefix
            rows += [
                ("jaxspec_prefix_cache_hits_total", "counter", "Prompts that started with cached prefix pages",
                 [({}, p.get("hits", 0))]),
                ("jaxspec_prefix_cache_misses_total", "counter", "Prompts admitted while the prefix cache held none "
                 "of their pages", [({}, p.get("misses", 0))]),
                ("jaxspec_prefix_cache_hit_tokens_total", "counter", "Prompt tokens restored from the prefix cache "
                 "instead of prefilled", [({}, p.get("hit_tokens", 0))]),
                ("jaxspec_prefix_cache_pages_in_use", "gauge", "Pages of the prefix cache holding a prompt's tokens",
                 [({}, p.get("pages_cached", 0))]),
                ("jaxspec_prefix_cache_pages_held", "gauge", "Pages held by prompts being admitted",
                 [({}, p.get("pages_referenced", 0))]),
                ("jaxspec_prefix_cache_pages", "gauge", "Pages of the prefix cache", [({}, p.get("num_pages", 0))]),
                ("jaxspec_prefix_cache_evictions_total", "counter", "Cached pages evicted to make room",
                 [({}, p.get("evictions", 0))]),
            ]
        lines = []
        for name, kind, help_, samples in rows:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            for labels, value in samples:
                label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"{name}{label} {_number(value)}")
        return "\n".join(lines) + "\n"
