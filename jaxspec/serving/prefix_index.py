"""The host-side index of a server's prefix cache: which pool pages hold which prompt prefixes, and which to evict.

The server keeps a pool of `num_pages` device pages, each holding the caches of `page_size` (P) consecutive prompt
positions. Page i of a prompt covers positions [i*P, (i+1)*P) and is identified by

    (pool page id of page i-1 of the same prompt, or -1 for page 0,  tuple(tokens[i*P : (i+1)*P + 1]))

Why the key looks like this:

- The overlap token. The key holds one token past the page, token (i+1)*P: the speculative draft's cache entry at a
  page's last position is computed from the next token, so two prompts that agree on a page's P tokens but not on
  the token after it do not share that page. A page is therefore a candidate only when token (i+1)*P exists, which
  also keeps the prompt's last position out of every cached page: the engine always prefills at least that position
  (its logits give the first sampled token).
- Exact keys. The key is the token tuple itself, not a hash of it, so two different prefixes can never collide onto
  one page; a wrong hit would silently corrupt generations, which no hash width rules out.
- The parent page id. Naming the previous page's pool id makes the index a trie: a page is shared only where
  everything before it matches too, and a lookup walks from page 0 and stops at the first page not cached.

Eviction is leaf-first: only a page with reference count 0 and no cached child page may be evicted, the least
recently used of those first. Evicting an inner page would leave its cached children unreachable (no lookup can get
past the missing parent) while they still occupy the pool, and a reused pool id would then give those children a
parent they were never computed under. A page referenced by a running request is never evicted, and neither is a
page of the chain that the same `store` call is building.

Recency is a global stamp per page (later stamp, more recently used). The evictable leaves sit in a heap ordered by
stamp with lazy deletion: an entry is checked against the page's current state when it comes to the top, and the
heap is rebuilt from the live pages once stale entries outnumber the pool, so every page operation is O(log n).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Sequence

PageKey = tuple[int, tuple[int, ...]]


def _token_list(tokens) -> Sequence[int]:
    """A numpy array becomes a list of Python ints (keys then hold plain ints); other sequences pass through."""
    return tokens.tolist() if hasattr(tokens, "tolist") else tokens


class PrefixIndex:
    """The prefix cache's index over a pool of `num_pages` pages of `page_size` positions; `num_pages == 0` disables it.

    Per request: `acquire(tokens)` gives the cached pages of the prompt's longest cached prefix (and holds them),
    `store(tokens, have)` registers the prompt's further pages and says which ones the caller must write, and
    `release(have)` drops the hold once the request no longer reads those pages.
    """

    def __init__(self, num_pages: int, page_size: int):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be an integer >= 0, got {num_pages!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.hits = 0  # acquire calls that matched at least one page
        self.misses = 0  # acquire calls that matched none
        self.hit_tokens = 0  # prompt positions served from cached pages, over all acquire calls
        self.evictions = 0
        self.pages_referenced = 0  # pages with reference count > 0
        self._page_of_key: dict[PageKey, int] = {}
        self._key_of_page: list[PageKey | None] = [None] * num_pages
        self._ref_count = [0] * num_pages
        self._cached_children = [0] * num_pages
        self._last_used = [0] * num_pages
        self._clock = 0
        self._free_pages = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self._evictable_heap: list[tuple[int, int]] = []  # (last_used, page); an entry may be stale

    # ---------------------------------------------------------------- public API

    @property
    def pages_cached(self) -> int:
        return len(self._page_of_key)

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
                "pages_cached": self.pages_cached, "pages_referenced": self.pages_referenced,
                "evictions": self.evictions, "num_pages": self.num_pages, "page_size": self.page_size}

    def candidate_pages(self, num_tokens: int) -> int:
        """How many pages of a prompt of `num_tokens` tokens can be cached: page i needs token (i+1)*P to exist."""
        return max(num_tokens - 1, 0) // self.page_size

    def _match(self, tokens: Sequence[int]) -> list[int]:
        matched: list[int] = []
        if self.num_pages:
            parent = -1
            for i in range(self.candidate_pages(len(tokens))):
                page = self._page_of_key.get(self._key(tokens, i, parent))
                if page is None:
                    break
                matched.append(page)
                parent = page
        return matched

    def peek(self, tokens) -> int:
        """How many pages `acquire` would match now; changes nothing (no count, no recency, no stats)."""
        return len(self._match(_token_list(tokens)))

    def acquire(self, tokens) -> list[int]:
        """Pool page ids of the longest cached chain matching the prompt from page 0 on; each is held (reference
        count + 1) and marked most recently used, in chain order."""
        matched = self._match(_token_list(tokens))
        for page in matched:
            if self._ref_count[page] == 0:
                self.pages_referenced += 1
            self._ref_count[page] += 1
            self._touch(page)
        if matched:
            self.hits += 1
            self.hit_tokens += len(matched) * self.page_size
        else:
            self.misses += 1
        return matched

    def release(self, pages: Sequence[int]) -> None:
        """Drops one hold on each page (a page listed twice drops two); nothing changes if any count would go
        below 0."""
        drops = collections.Counter(pages)
        for page, n in drops.items():
            if not (isinstance(page, int) and 0 <= page < self.num_pages):
                raise ValueError(f"release: page {page!r} is not a page of this pool of {self.num_pages}")
            if self._ref_count[page] < n:
                raise ValueError(f"release: page {page} has reference count {self._ref_count[page]}, "
                                 f"cannot release it {n} time(s)")
        for page, n in drops.items():
            self._ref_count[page] -= n
            if self._ref_count[page] == 0:
                self.pages_referenced -= 1
                self._push_if_evictable(page)

    def store(self, tokens, have: Sequence[int]) -> list[tuple[int, int]]:
        """Registers the prompt's candidate pages after `have` (what `acquire` returned for this prompt), in order.

        Returns [(page index in the prompt, pool page id)] for the pages the caller must now write. A page already
        cached (stored by another prompt since `acquire`) continues the chain as it is and is not returned. The
        chain stops at the first page for which no pool page can be had: no free page and no evictable leaf outside
        this chain. Stored and continued pages are marked most recently used, in chain order, and stored pages start
        with reference count 0.
        """
        tokens = _token_list(tokens)
        num_candidates = self.candidate_pages(len(tokens))
        parent = -1
        for i, page in enumerate(have):
            if (i >= num_candidates or not (isinstance(page, int) and 0 <= page < self.num_pages)
                    or self._key_of_page[page] != self._key(tokens, i, parent)):
                raise ValueError(f"store: have[{i}] = {page!r} is not page {i} of this prompt's cached chain")
            parent = page
        to_write: list[tuple[int, int]] = []
        if not self.num_pages:
            return to_write
        for i in range(len(have), num_candidates):
            key = self._key(tokens, i, parent)
            page = self._page_of_key.get(key)
            if page is None:
                # only the chain's last page can be a leaf: every earlier page of it has the next one as a child
                page = self._allocate(keep=parent)
                if page is None:
                    break
                self._register(page, key)
                to_write.append((i, page))
            self._touch(page)
            parent = page
        return to_write

    def check_invariants(self) -> None:
        """Raises RuntimeError if the index is inconsistent (for tests and debugging; O(num_pages))."""
        def fail(msg):
            raise RuntimeError(f"PrefixIndex invariant: {msg}")
        if len(self._page_of_key) > self.num_pages:
            fail(f"{len(self._page_of_key)} keys for {self.num_pages} pages")
        children = [0] * self.num_pages
        for key, page in self._page_of_key.items():
            if self._key_of_page[page] != key:
                fail(f"page {page} is held by key {key!r} but records {self._key_of_page[page]!r}")
            parent = key[0]
            if parent != -1:
                if not (0 <= parent < self.num_pages) or self._key_of_page[parent] is None:
                    fail(f"page {page}'s parent {parent} is not cached")
                children[parent] += 1
            if len(key[1]) != self.page_size + 1:
                fail(f"page {page}'s key has {len(key[1])} tokens")
        for page in range(self.num_pages):
            if self._key_of_page[page] is not None and self._page_of_key.get(self._key_of_page[page]) != page:
                fail(f"page {page} records a key that does not map back to it")
            if self._key_of_page[page] is None and self._ref_count[page]:
                fail(f"uncached page {page} has reference count {self._ref_count[page]}")
        if children != self._cached_children:
            fail("cached-children counts disagree with the keys")
        if any(n < 0 for n in self._ref_count):
            fail("negative reference count")
        if sum(n > 0 for n in self._ref_count) != self.pages_referenced:
            fail("pages_referenced disagrees with the reference counts")
        # reachability: parents are cached (above) and a parent was registered before its child, so walking parent
        # links from any page ends at the root; check it ends without a cycle
        for page in range(self.num_pages):
            seen = 0
            key = self._key_of_page[page]
            while key is not None and key[0] != -1:
                seen += 1
                if seen > self.num_pages:
                    fail(f"page {page}'s parent chain has a cycle")
                key = self._key_of_page[key[0]]
        free = set(self._free_pages)
        if len(free) != len(self._free_pages) or any(self._key_of_page[p] is not None for p in free):
            fail("free list holds a cached page or a page twice")
        if len(free) + len(self._page_of_key) > self.num_pages:
            fail("free pages and cached pages overlap")

    # ---------------------------------------------------------------- internals

    def _key(self, tokens: Sequence[int], i: int, parent: int) -> PageKey:
        start = i * self.page_size
        return parent, tuple(tokens[start: start + self.page_size + 1])

    def _touch(self, page: int) -> None:
        self._clock += 1
        self._last_used[page] = self._clock
        self._push_if_evictable(page)

    def _is_evictable(self, page: int) -> bool:
        return (self._key_of_page[page] is not None and self._ref_count[page] == 0
                and self._cached_children[page] == 0)

    def _push_if_evictable(self, page: int) -> None:
        if not self._is_evictable(page):
            return
        heapq.heappush(self._evictable_heap, (self._last_used[page], page))
        if len(self._evictable_heap) > 2 * self.num_pages + 16:
            self._evictable_heap = [(self._last_used[p], p) for p in range(self.num_pages) if self._is_evictable(p)]
            heapq.heapify(self._evictable_heap)

    def _pop_least_recent_leaf(self, keep: int) -> int | None:
        """Removes and returns the least recently used evictable page other than `keep`, or None."""
        heap = self._evictable_heap
        kept_entry = None
        victim = None
        while heap:
            last_used, page = heapq.heappop(heap)
            if last_used != self._last_used[page] or not self._is_evictable(page):
                continue  # stale: the page was used, referenced, given a child or evicted since
            if page == keep:
                kept_entry = (last_used, page)
                continue
            victim = page
            break
        if kept_entry is not None:
            heapq.heappush(heap, kept_entry)
        return victim

    def _allocate(self, keep: int) -> int | None:
        if self._free_pages:
            return self._free_pages.pop()
        victim = self._pop_least_recent_leaf(keep)
        if victim is None:
            return None
        self._unregister(victim)
        self.evictions += 1
        return victim

    def _register(self, page: int, key: PageKey) -> None:
        self._page_of_key[key] = page
        self._key_of_page[page] = key
        parent = key[0]
        if parent != -1:
            self._cached_children[parent] += 1

    def _unregister(self, page: int) -> None:
        key = self._key_of_page[page]
        del self._page_of_key[key]
        self._key_of_page[page] = None
        parent = key[0]
        if parent != -1:
            self._cached_children[parent] -= 1
            self._push_if_evictable(parent)
