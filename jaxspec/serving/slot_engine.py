"""The device side of the server: the slots' state and the compiled programs that change it (prefill a prompt
into a slot, run a few cycles over all slots). Called from one thread only (the scheduler's).

Programs are compiled ahead of time once per static shape and kept: the loop (K, sampled or not), the insert,
and the prefill per prompt bucket and greedy/sampled first token. Every per-request value (slot index, budget,
sampling values, seed) is traced, so requests never cause a compile beyond a new prompt bucket.

With a prefix cache (`prefix_cache_tokens`), every prefilled prompt's full pages are saved into a pool of pages
(`jaxspec.serving.prefix_pages`), and a prompt that starts with cached pages (`jaxspec.serving.prefix_index`)
has them restored and prefills only the rest, a chunk at a time from where they end.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import SpecConfig, SpecWeights
from jaxspec.prefill import (DEFAULT_CHUNK, baseline_prefill, baseline_state, next_tokens, prefill_carry,
                             prefill_chunk, prefill_keys, prompt_bucket, spec_prefill, spec_state)
from jaxspec.sampling import SamplingParams
from jaxspec.serving.prefix_index import PrefixIndex
from jaxspec.serving.prefix_pages import PAGE_TOKENS, init_prefix_pages, restore_pages, save_pages
from jaxspec.serving.slot_cycle import run_cycles
from jaxspec.serving.slots import init_slots, insert_prefilled
from jaxspec.sharded import compile_program, compile_programs, output_shapes, weights_to_run
from model.kv_cache import round_capacity


@dataclasses.dataclass
class StepResult:
    tokens: list[list[int]]  # new tokens per slot
    done: np.ndarray  # [B] bool
    accepted: int  # drafts accepted, summed over the live slot-cycles
    slot_cycles: int  # live slot-cycles (a slot's share of a cycle)
    cycles: int  # cycles the device ran
    k: int
    accepted_by_count: tuple[int, ...] = ()  # [K+1]: live slot-cycles that accepted 0..K drafts
    probe: tuple[int, int] = (0, 0)  # plain steps of a speculating server: (draft's first guess emitted, tried)
    seconds: float = 0.0  # the loop's wall time, launch to its results on the host


def fixed_k(k: int):
    """The draft length policy of a server with fixed speculation: always `k`. An adaptive policy takes the same
    place (`SlotEngine(choose_k=...)`, jaxspec.serving.adaptive_k): it sees the last step's result (None before the
    first) and returns the K of the next device loop, 0 <= K <= num_steps (the context check reserves num_steps + 1
    verify positions; a plain loop of a speculating server extends the draft by the tokens it emits). Its `ks`
    attribute, where it has one, names the K whose loops `warm_up` compiles."""
    return lambda last: k


@dataclasses.dataclass
class Admission:
    """A prompt being prefilled a chunk at a time (`SlotEngine.begin_admission`): its tokens padded to whole
    chunks past the cached prefix, and the batch-1 caches the cached pages and the chunks so far wrote."""
    tokens: np.ndarray  # [1, cached prefix + whole chunks]
    next: np.ndarray  # [1, as tokens]: the token after each position (`jaxspec.prefill.next_tokens`)
    length: int
    sampling: SamplingParams
    state_key: jax.Array
    first_key: jax.Array
    carry: tuple | None
    start: int = 0  # the next chunk's first position
    cached_pages: list[int] = dataclasses.field(default_factory=list)  # prefix pages restored, held until it ends
    slot_pages: list[int] = dataclasses.field(default_factory=list)  # the slot's cache pages, taken when it began
    # the prefix index `cached_pages` are held in: an emptied prefix cache (`clear_prefix_cache`) is a new index,
    # and the old one's holds and pages are gone with it
    prefix: PrefixIndex | None = None

    @property
    def prefilled(self) -> bool:
        return self.start >= self.length


def _admission_chunk(w, toks, nxt, lengths, key, sp, start, carry, *, cfg, greedy):
    return prefill_chunk(w, cfg, toks, nxt, lengths, key, sp, greedy, start, carry)


def _restore_into_carry(pool, carry, page_ids_M, hit_tokens):
    target_cache, draft_cache = restore_pages(pool, carry[0], carry[1], page_ids_M, hit_tokens)
    return (target_cache, draft_cache, *carry[2:])


def _save_state_pages(pool, one, page_ids_M):
    return save_pages(pool, one.target_cache, getattr(one, "draft_cache", None), page_ids_M)


class SlotEngine:
    def __init__(self, cfg: SpecConfig, weights: SpecWeights, *, num_steps: int, max_batch: int, max_context: int,
                 cycles_per_step: int = 4, prefill_chunk: int = DEFAULT_CHUNK, mesh=None, choose_k=None,
                 prefix_cache_tokens: int = 0, cache_pages: int | None = None):
        if num_steps > 0 and (cfg.draft is None or weights.draft is None):
            raise ValueError("speculative decoding (num_steps > 0) needs a draft model")
        if max_context > cfg.target.max_position_embeddings:
            raise ValueError(f"max_context {max_context} exceeds the model's {cfg.target.max_position_embeddings} "
                             "positions")
        self.cfg, self.k, self.mesh = cfg, num_steps, mesh
        self.weights = weights_to_run(weights, mesh)
        self.max_batch, self.max_context = max_batch, max_context
        self.cycles_per_step, self.prefill_chunk = cycles_per_step, prefill_chunk
        self.capacity = round_capacity(max_context)
        self.choose_k = choose_k or fixed_k(num_steps)
        self.dtype = self.weights.target.dtype
        if cache_pages is not None and cache_pages < self.capacity // PAGE_TOKENS:
            raise ValueError(f"cache_pages {cache_pages} cannot hold one request of max_context {max_context} "
                             f"({self.capacity // PAGE_TOKENS} pages of {PAGE_TOKENS})")
        self.cache_pages = cache_pages
        self.reset()
        self._programs: dict[tuple, object] = {}
        self._carry_shapes_cache = None
        self.compile_s = 0.0
        self._last: StepResult | None = None
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self._prefix_pages = prefix_cache_tokens // PAGE_TOKENS
        self.clear_prefix_cache()

    def clear_prefix_cache(self) -> None:
        """Empty the prefix cache (also done after a program that changes the pool failed: the pool it was given
        may be gone). Programs stay compiled."""
        self.prefix = PrefixIndex(self._prefix_pages, PAGE_TOKENS)
        self.pages = None
        if self._prefix_pages:
            carry = self._carry_shapes()
            self.pages = init_prefix_pages(carry[0], carry[1], self._prefix_pages)

    def reset(self) -> None:
        """Every slot idle (after a failed step: its donated state may be gone)."""
        self.state = init_slots(self.cfg, self.weights, self.max_batch, self.capacity, self.dtype,
                                with_draft=self.k > 0, cache_pages=self.cache_pages, page_tokens=PAGE_TOKENS)
        self._free_pages = list(range(self.cache_pages or 0))
        self._slot_pages: dict[int, list[int]] = {}  # paged cache: the pool pages each running slot holds
        self._slot_tokens: dict[int, int] = {}  # ... the tokens its sequence holds (prompt and emitted)
        self._slot_budget: dict[int, int] = {}  # ... the most positions it can ever write
        self._slot_admitted: dict[int, int] = {}  # ... its admission's order (preemption takes the latest first)
        self._admissions = 0

    # --- the paged cache -----------------------------------------------------------------------------
    # A request takes pages for its prompt and its first device loop when admitted, then before every device loop
    # each running request takes what that loop may write (`grow_pages`); when the pool cannot give every running
    # request its next loop's pages, the most recently admitted ones are preempted (`slots_to_preempt`): their
    # pages go back and the scheduler re-queues them to resume from their prompt and the tokens they emitted.
    def _budget(self, prompt_len: int, max_new: int | None) -> int:
        """The most positions a request can ever write: prompt, tokens asked, the verify window."""
        return self.capacity if max_new is None else min(self.capacity, prompt_len + max_new + self.k + 1)

    def _loop_positions(self) -> int:
        """Positions one device loop may write past a sequence's tokens: each cycle writes its K + 1 verify tokens
        from the last committed position and commits at most K + 1."""
        return self.cycles_per_step * (self.k + 1)

    def pages_for(self, prompt_len: int, max_new: int | None) -> int:
        """Cache pages a request takes when admitted (its prompt and what its first device loop may write, within
        its budget); 0 when the cache is not paged."""
        if self.cache_pages is None:
            return 0
        return -(-min(self._budget(prompt_len, max_new), prompt_len + 1 + self._loop_positions()) // PAGE_TOKENS)

    def _pages_needed(self, slot: int) -> int:
        """Pages slot's sequence must hold before the next device loop."""
        tokens, budget = self._slot_tokens[slot], self._slot_budget[slot]
        return -(-min(budget, tokens + self._loop_positions()) // PAGE_TOKENS)

    def _growth(self) -> dict[int, int]:
        """{slot: pages it must take before the next device loop} for the slots that must take any."""
        more = {s: self._pages_needed(s) - len(pages) for s, pages in self._slot_pages.items()}
        return {s: n for s, n in more.items() if n > 0}

    def has_room(self, prompt_len: int, max_new: int | None) -> bool:
        """Whether the cache has the pages a request takes when admitted, besides what the running requests take
        for the next device loop (it waits in the queue otherwise, rather than push a running one out)."""
        if self.cache_pages is None:
            return True
        return self.pages_for(prompt_len, max_new) + sum(self._growth().values()) <= len(self._free_pages)

    def pages_short(self) -> int:
        """How many pages the running slots' next device loop lacks (0 when the pool has them)."""
        if self.cache_pages is None:
            return 0
        return max(0, sum(self._growth().values()) - len(self._free_pages))

    def slots_to_preempt(self) -> list[int]:
        """The running slots to preempt, most recently admitted first, so that every other one's pages cover its
        next device loop; [] when the pool has room for all. A slot alone always fits (the pool holds at least one
        whole context)."""
        growth, free = self._growth(), len(self._free_pages)
        victims = []
        for s in sorted(self._slot_pages, key=self._slot_admitted.get, reverse=True):
            if sum(growth.values()) <= free or len(victims) == len(self._slot_pages) - 1:
                break
            victims.append(s)
            growth.pop(s, None)
            free += len(self._slot_pages[s])
        return victims

    def grow_pages(self) -> None:
        """Give every running slot the pages its next device loop may write (`slots_to_preempt` made room)."""
        growth = self._growth()
        if not growth:
            return
        if sum(growth.values()) > len(self._free_pages):
            raise RuntimeError(f"the cache has {len(self._free_pages)} free pages, the running requests' next device "
                               f"loop needs {sum(growth.values())}")
        for s, n in growth.items():
            self._slot_pages[s] += self._free_pages[:n]
            self._free_pages = self._free_pages[n:]
        self._write_table()

    def _write_table(self) -> None:
        """The block table as the slots hold pages now: a slot's pages in order, the pool's size (none) elsewhere,
        idle slots included (they are still computed and write where their row points)."""
        table_BM = np.full(self.state.target_cache.pages_BM.shape, self.cache_pages, np.int32)
        for s, pages in self._slot_pages.items():
            table_BM[s, : len(pages)] = pages
        old = self.state.target_cache.pages_BM
        self.state = self.state.replace(target_cache=self.state.target_cache.replace(
            pages_BM=jax.device_put(table_BM, old.sharding)))

    @property
    def cache_pages_free(self) -> int:
        return len(self._free_pages)

    @property
    def cache_tokens_held(self) -> int:
        """Tokens the running slots' sequences hold (prompt and emitted) in a paged cache."""
        return sum(self._slot_tokens.values())

    def _take_pages(self, prompt_len: int, max_new: int | None) -> list[int]:
        n = self.pages_for(prompt_len, max_new)
        if n > len(self._free_pages):
            raise RuntimeError(f"the cache has {len(self._free_pages)} free pages, a request of {prompt_len} tokens "
                               f"asking {max_new} needs {n}")
        taken, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        return taken

    def free_slots(self, slots) -> None:
        """The slots' requests ended (finished, cancelled, failed, preempted): their pages go back to the pool, their
        table rows cleared (an idle slot is still computed and writes where its row points)."""
        held = [s for s in slots if s in self._slot_pages]
        if not held:
            return
        for s in held:
            self._free_pages += self._slot_pages.pop(s)
            del self._slot_tokens[s], self._slot_budget[s], self._slot_admitted[s]
        self._write_table()

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a prompt of `prompt_len` may ask for: the verify window (K + 1) must fit too."""
        return self.max_context - prompt_len - self.k - 1

    # --- compilation ---------------------------------------------------------------------------------
    def _program(self, key: tuple, fn, args: tuple, donate: tuple = ()):
        hit = self._programs.get(key)
        if hit is None:
            t0 = time.perf_counter()
            hit = self._programs[key] = compile_program(fn, args, donate, self.mesh)
            self.compile_s += time.perf_counter() - t0
        return hit

    def warm_up(self, buckets=(16,)):
        """Compile the loops (greedy-only and mixed), the prefill programs for `buckets` and the insert before
        serving, side by side (`jaxspec.sharded.compile_programs`)."""
        cancel = jnp.zeros((self.max_batch,), bool)
        ks = getattr(self.choose_k, "ks", (self.k,))  # an adaptive policy's every K
        specs = [self._loop_spec(k, sampled, cancel) for k in ks for sampled in (False, True)]
        specs += [self._prefill_spec(bucket, greedy) for greedy in (True, False) for bucket in buckets]
        _, prefill_fn, prefill_args, _ = self._prefill_spec(prompt_bucket(1), True)
        one = output_shapes(prefill_fn, prefill_args, self.mesh)  # what any prefill hands the insert
        specs.append(self._insert_spec(one))
        if self.max_context > self.prefill_chunk or self.pages is not None:
            specs += self._admission_specs()
        if self.pages is not None:
            specs += [self._save_spec(one), self._restore_spec(self._carry_shapes())]
        todo = [spec for spec in specs if spec[0] not in self._programs]
        t0 = time.perf_counter()
        programs = compile_programs([(fn, args, donate) for _, fn, args, donate in todo], self.mesh)
        self._programs.update((key, program) for (key, *_), program in zip(todo, programs))
        self.compile_s += time.perf_counter() - t0

    def _loop_spec(self, k: int, sampled: bool, cancel) -> tuple:
        fn = functools.partial(run_cycles, cfg=self.cfg, k=k, sampled=sampled, cycles=self.cycles_per_step)
        return ("loop", k, sampled), fn, (self.weights, self.state, cancel), (1,)

    def _loop(self, k: int, sampled: bool, cancel):
        return self._program(*self._loop_spec(k, sampled, cancel))

    def _prefill_args(self, tokens: np.ndarray, sampling: SamplingParams, seed: int):
        bucket = prompt_bucket(len(tokens))
        padded = np.full((1, bucket), self.cfg.target.pad_token_id or 0, np.int32)
        padded[0, : len(tokens)] = tokens
        args = (self.weights, jnp.asarray(padded), jnp.asarray([len(tokens)], jnp.int32), jax.random.key(seed),
                sampling.as_arrays())
        program = self._prefill_program(bucket, sampling.greedy)
        return program, program(*args)

    def _prefill_spec(self, bucket: int, greedy: bool) -> tuple:
        # max_new_tokens / max_cycles only size the batch-1 state's own output buffers, which the insert ignores
        common = dict(cfg=self.cfg, capacity=self.capacity, greedy=greedy, max_new_tokens=2, chunk=self.prefill_chunk)
        if self.k > 0:
            fn = functools.partial(spec_prefill, k=self.k, max_cycles=1, **common)
        else:
            fn = functools.partial(baseline_prefill, **common)
        sp = SamplingParams().as_arrays()
        args = (self.weights, jnp.zeros((1, bucket), jnp.int32), jnp.ones((1,), jnp.int32), jax.random.key(0), sp)
        return ("prefill", bucket, greedy), fn, args, ()

    def _prefill_program(self, bucket: int, greedy: bool):
        return self._program(*self._prefill_spec(bucket, greedy))

    def _insert_spec(self, one) -> tuple:
        fn = functools.partial(insert_prefilled, eos_ids=self.cfg.eos_ids)
        scalars = (jnp.int32(0), jnp.int32(1), jnp.bool_(True), jnp.float32(1), jnp.int32(0), jnp.float32(1))
        if self.cache_pages is not None:
            scalars += (jnp.zeros((self.capacity // PAGE_TOKENS,), jnp.int32),)
        return ("insert",), fn, (self.state, one, *scalars), (0,)

    def _insert_program(self, one):
        return self._program(*self._insert_spec(one))

    def _carry_spec(self) -> tuple:
        fn = functools.partial(prefill_carry, cfg=self.cfg, b=1, capacity=self.capacity, with_draft=self.k > 0)
        return ("admission_carry",), fn, (self.weights,), ()

    def _chunk_spec(self, greedy: bool, carry) -> tuple:
        fn = functools.partial(_admission_chunk, cfg=self.cfg, greedy=greedy)
        toks = jnp.zeros((1, self.prefill_chunk), jnp.int32)
        args = (self.weights, toks, toks, jnp.ones((1,), jnp.int32), jax.random.key(0), SamplingParams().as_arrays(),
                jnp.int32(0), carry)
        return ("admission_chunk", greedy), fn, args, (7,)

    def _finish_spec(self, carry) -> tuple:
        if self.k > 0:
            fn = functools.partial(spec_state, cfg=self.cfg, k=self.k, max_new_tokens=2, max_cycles=1)
        else:
            fn = functools.partial(baseline_state, cfg=self.cfg, max_new_tokens=2)
        return ("admission_finish",), fn, (carry, jnp.ones((1,), jnp.int32), jax.random.key(0)), (0,)

    def _carry_shapes(self):
        """The shapes of an admission's empty caches (`prefill_carry`), traced once: they are fixed for the engine's
        life."""
        if self._carry_shapes_cache is None:
            self._carry_shapes_cache = output_shapes(self._carry_spec()[1], (self.weights,), self.mesh)
        return self._carry_shapes_cache

    def _admission_specs(self) -> list[tuple]:
        """The programs of a prompt admitted a chunk at a time: its empty caches, a chunk (greedy and sampled), the
        state it hands the insert."""
        carry = self._carry_shapes()
        return [self._carry_spec(), self._chunk_spec(True, carry), self._chunk_spec(False, carry),
                self._finish_spec(carry)]

    def _save_spec(self, one) -> tuple:
        ids = jnp.zeros((self.capacity // PAGE_TOKENS,), jnp.int32)
        return ("prefix_save",), _save_state_pages, (self.pages, one, ids), (0,)

    def _restore_spec(self, carry) -> tuple:
        ids = jnp.zeros((self.capacity // PAGE_TOKENS,), jnp.int32)
        return ("prefix_restore",), _restore_into_carry, (self.pages, carry, ids, jnp.int32(0)), (1,)

    # --- the prefix cache ----------------------------------------------------------------------------
    def cached_prefix_tokens(self, tokens: list[int]) -> int:
        """How many of the prompt's leading tokens the prefix cache holds now (their prefill would be skipped)."""
        return self.prefix.peek(tokens) * PAGE_TOKENS

    def _page_ids(self, pages: dict[int, int], pool_size: int) -> jax.Array:
        """{page of a sequence: pool page} as the programs take it: one id per page of the capacity, the pool's
        size (no page) where none is given."""
        ids = np.full((self.capacity // PAGE_TOKENS,), pool_size, np.int32)
        for m, page in pages.items():
            ids[m] = page
        return jnp.asarray(ids)

    def _save_prefix(self, tokens, cached_pages: list[int], one) -> None:
        """Save the full pages of a prefilled prompt that the cache lacks (as room allows) from its batch-1
        state `one`."""
        if self.pages is None:
            return
        new = self.prefix.store(list(tokens), cached_pages)
        if not new:
            return
        key = ("prefix_save",)
        save = self._programs.get(key) or self._program(*self._save_spec(one))
        try:
            self.pages = save(self.pages, one, self._page_ids(dict(new), self._prefix_pages))
        except Exception:
            self.clear_prefix_cache()  # the pool was given to the program that failed
            raise

    def release_admission(self, a: Admission) -> None:
        """An admission that ends without being finished (its request cancelled or failed) gives back the cached
        pages it holds."""
        if a.cached_pages:
            if a.prefix is self.prefix:
                self.prefix.release(a.cached_pages)
            a.cached_pages = []
        self._free_pages += a.slot_pages
        a.slot_pages = []

    # --- running -------------------------------------------------------------------------------------
    def prefill(self, slot: int, tokens: list[int], max_new: int, sampling: SamplingParams, seed: int) -> tuple[int, bool]:
        """Prefill `tokens` into `slot` now; returns (first token, done already). A prompt with cached pages is
        restored from them and prefilled from where they end, a chunk at a time; any other in one program."""
        if self.cached_prefix_tokens(tokens):
            a = self.begin_admission(tokens, sampling, seed, max_new)
            try:
                while not a.prefilled:
                    self.admit_chunk(a)
            except Exception:
                self.release_admission(a)
                raise
            return self.finish_admission(slot, a, max_new)
        pages = self._take_pages(len(tokens), max_new)
        try:
            if self.pages is not None:
                self.prefix.acquire(tokens)  # nothing cached: counted as a miss
            _, one = self._prefill_args(np.asarray(tokens, np.int32), sampling, seed)
            self._save_prefix(tokens, [], one)
        except Exception:
            self._free_pages += pages
            raise
        return self._insert(slot, one, len(tokens), max_new, sampling, pages)

    def _insert(self, slot: int, one, prompt_len: int, max_new: int, sampling: SamplingParams,
                pages: list[int]) -> tuple[int, bool]:
        insert = self._insert_program(one)
        args = [self.state, one, jnp.int32(slot), jnp.int32(max_new), jnp.bool_(sampling.greedy),
                jnp.float32(sampling.temperature), jnp.int32(sampling.top_k), jnp.float32(sampling.top_p)]
        if self.cache_pages is not None:
            args.append(self._page_ids(dict(enumerate(pages)), self.cache_pages))
        try:
            self.state = insert(*args)
        except Exception:
            self._free_pages += pages
            raise
        if self.cache_pages is not None:
            self._slot_pages[slot] = pages
            self._slot_tokens[slot] = prompt_len + 1
            self._slot_budget[slot] = self._budget(prompt_len, max_new)
            self._slot_admitted[slot], self._admissions = self._admissions, self._admissions + 1
        first, done = jax.device_get((one.pending[0], self.state.done[slot]))
        return int(first), bool(done)

    def admits_in_chunks(self, tokens: list[int]) -> bool:
        """Whether this prompt is prefilled a chunk at a time between device steps (`begin_admission`), so the
        slots already running keep emitting while it is admitted: what the prefix cache lacks of it is longer
        than a chunk."""
        return len(tokens) - self.cached_prefix_tokens(tokens) > self.prefill_chunk

    def begin_admission(self, tokens: list[int], sampling: SamplingParams, seed: int,
                        max_new: int | None = None) -> Admission:
        """A prompt to prefill a chunk at a time (`admit_chunk`, then `finish_admission`), from the end of its
        cached pages (restored now, and held until the admission ends). A paged cache's pages for the prompt and
        its first device loop (`pages_for`) are taken now, so its insert cannot run short."""
        size = self.prefill_chunk
        slot_pages = self._take_pages(len(tokens), max_new)
        cached = self.prefix.acquire(list(tokens)) if self.pages is not None else []
        start = len(cached) * PAGE_TOKENS
        padded = np.zeros((1, start + -(-(len(tokens) - start) // size) * size), np.int32)
        padded[0, : len(tokens)] = tokens
        state_key, first_key = prefill_keys(jax.random.key(seed))
        try:
            carry = self._program(*self._carry_spec())(self.weights)
            if cached:
                restore = self._programs.get(("prefix_restore",)) or self._program(*self._restore_spec(carry))
                carry = restore(self.pages, carry, self._page_ids(dict(enumerate(cached)), self._prefix_pages), jnp.int32(start))
        except Exception:
            self.prefix.release(cached)
            self._free_pages += slot_pages
            raise
        return Admission(padded, np.asarray(next_tokens(padded)), len(tokens), sampling, state_key, first_key, carry,
                         start, cached, slot_pages, self.prefix)

    def admit_chunk(self, a: Admission) -> None:
        """Prefill the next chunk of `a`'s prompt."""
        size = self.prefill_chunk
        key = ("admission_chunk", a.sampling.greedy)  # found without building the spec's example arguments
        chunk = self._programs.get(key) or self._program(*self._chunk_spec(a.sampling.greedy, a.carry))
        a.carry = chunk(self.weights, jnp.asarray(a.tokens[:, a.start : a.start + size]),
                        jnp.asarray(a.next[:, a.start : a.start + size]), jnp.asarray([a.length], jnp.int32),
                        a.first_key, a.sampling.as_arrays(), jnp.int32(a.start), a.carry)
        a.start += size

    def finish_admission(self, slot: int, a: Admission, max_new: int) -> tuple[int, bool]:
        """Insert `a` (every chunk prefilled) into `slot`; returns (first token, done already)."""
        if not a.prefilled:
            raise ValueError(f"admission of {a.length} tokens finished at position {a.start}")
        pages, a.slot_pages = a.slot_pages, []  # the insert owns them now
        try:
            finish = self._programs.get(("admission_finish",)) or self._program(*self._finish_spec(a.carry))
            one = finish(a.carry, jnp.asarray([a.length], jnp.int32), a.state_key)
            a.carry = None
            # the pages it restored are the start of its chain, unless the prefix cache was emptied since
            have = a.cached_pages if a.prefix is self.prefix else []
            self._save_prefix(a.tokens[0, : a.length].tolist(), have, one)
        except Exception:
            self._free_pages += pages
            raise
        finally:
            self.release_admission(a)
        return self._insert(slot, one, a.length, max_new, a.sampling, pages)

    def step(self, cancel: np.ndarray, any_sampled: bool) -> StepResult:
        """A few cycles over every slot (after ending the slots in `cancel`); the tokens each slot emitted."""
        k = self.choose_k(self._last)
        if self.cache_pages is not None:
            self.grow_pages()
        loop = self._loop(k, any_sampled, jnp.asarray(cancel))
        if hasattr(self.choose_k, "ks"):  # a policy timing the loops: queued admissions are not the loop's time
            jax.block_until_ready(self.state)
        t0 = time.perf_counter()
        self.state, out = loop(self.weights, self.state, jnp.asarray(cancel))
        buf, counts, done, accepted, slot_cycles, cycles, accepted_K1, probe = jax.device_get(out)
        seconds = time.perf_counter() - t0
        tokens = [buf[i, : counts[i]].tolist() for i in range(self.max_batch)]
        for slot in self._slot_tokens:
            self._slot_tokens[slot] += len(tokens[slot])
        self._last = StepResult(tokens, np.asarray(done), int(accepted), int(slot_cycles), int(cycles), k,
                                tuple(int(n) for n in accepted_K1), (int(probe[0]), int(probe[1])), seconds)
        return self._last
