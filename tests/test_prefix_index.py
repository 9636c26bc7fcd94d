"""PrefixIndex: the prefix cache's trie of exact page keys, its leaf-first LRU eviction, and a brute-force model."""

import random

import numpy as np
import pytest

from jaxspec.serving.prefix_index import PrefixIndex


def cache(index, tokens):
    """One request: acquire, store the rest, release; returns (acquired pages, pages to write)."""
    have = index.acquire(tokens)
    written = index.store(tokens, have)
    index.release(have)
    index.check_invariants()
    return have, written


def test_constructor_validation():
    with pytest.raises(ValueError, match="page_size"):
        PrefixIndex(num_pages=4, page_size=0)
    with pytest.raises(ValueError, match="num_pages"):
        PrefixIndex(num_pages=-1, page_size=4)
    PrefixIndex(num_pages=0, page_size=1)


def test_last_position_never_cached():
    p = 4
    for k in (1, 2, 3):
        index = PrefixIndex(num_pages=16, page_size=p)
        _, written = cache(index, list(range(k * p)))
        assert [i for i, _ in written] == list(range(k - 1))
        index = PrefixIndex(num_pages=16, page_size=p)
        _, written = cache(index, list(range(k * p + 1)))
        assert [i for i, _ in written] == list(range(k))
    index = PrefixIndex(num_pages=16, page_size=p)
    assert cache(index, []) == ([], [])
    assert cache(index, [7]) == ([], [])


def test_chain_semantics_and_overlap_token():
    index = PrefixIndex(num_pages=16, page_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # candidate pages: [1,2|3], [3,4|5], [5,6|7]
    have, written = cache(index, prompt)
    assert have == [] and written == [(0, 0), (1, 1), (2, 2)]
    assert index.acquire(prompt) == [0, 1, 2]
    index.release([0, 1, 2])
    # a page hits only when everything before it matches: page 1's tokens alone are not enough
    assert index.acquire([9, 9, 3, 4, 5, 6, 7]) == []
    # same page-1 tokens but a different next token (the overlap): page 0 hits, page 1 misses
    assert index.acquire([1, 2, 3, 4, 9, 6, 7]) == [0]
    # same first page tokens, different overlap token: nothing hits
    assert index.acquire([1, 2, 9, 4, 5]) == []
    # a shorter prompt hits only its own candidates
    assert index.acquire([1, 2, 3, 4, 5]) == [0, 1]
    assert index.acquire([1, 2, 3, 4]) == [0]
    index.check_invariants()


def test_store_after_partial_hit_and_numpy_tokens():
    index = PrefixIndex(num_pages=16, page_size=2)
    cache(index, [1, 2, 3, 4, 5])
    prompt = np.array([1, 2, 3, 4, 5, 7, 8], dtype=np.int32)
    have = index.acquire(prompt)
    assert have == [0, 1]
    written = index.store(prompt, have)
    assert written == [(2, 2)]
    index.release(have)
    assert index.acquire([1, 2, 3, 4, 5, 7, 8, 9]) == [0, 1, 2]
    index.check_invariants()


def test_store_continues_a_chain_stored_since_acquire():
    index = PrefixIndex(num_pages=16, page_size=2)
    a = [1, 2, 3, 4, 5, 6, 7]
    b = [1, 2, 3, 4, 5, 6, 9, 9, 9]
    have_a, have_b = index.acquire(a), index.acquire(b)
    assert have_a == have_b == []
    assert index.store(a, have_a) == [(0, 0), (1, 1), (2, 2)]
    # b's first two pages are now cached: they continue its chain and are not returned
    assert index.store(b, have_b) == [(2, 3), (3, 4)]
    assert index.acquire(b) == [0, 1, 3, 4]
    index.check_invariants()


def test_store_rejects_a_have_that_is_not_the_prompts_chain():
    index = PrefixIndex(num_pages=4, page_size=2)
    cache(index, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="have"):
        index.store([1, 2, 3, 4, 5], [1])
    with pytest.raises(ValueError, match="have"):
        index.store([1, 2, 3], [0, 1])


def test_lru_eviction_is_leaf_first():
    index = PrefixIndex(num_pages=4, page_size=1)
    cache(index, [1, 2, 3])  # pages 0 ([1,2]) and 1 ([2,3], child of 0)
    cache(index, [5, 6])  # page 2
    cache(index, [7, 8])  # page 3
    assert index.pages_cached == 4
    # page 0 is the least recently used but has a cached child: the leaf page 1 goes first
    _, written = cache(index, [9, 9])
    assert written == [(0, 1)]
    assert index.evictions == 1
    assert index.acquire([1, 2, 3]) == [0]  # the parent is still cached, the child is gone
    index.release([0])
    # now page 2 is the least recently used leaf
    _, written = cache(index, [4, 4])
    assert written == [(0, 2)]
    assert index.acquire([5, 6]) == []
    index.check_invariants()


def test_eviction_order_follows_recency_of_use():
    index = PrefixIndex(num_pages=3, page_size=1)
    for prompt in ([1, 1], [2, 2], [3, 3]):
        cache(index, prompt)
    cache(index, [1, 1])  # page 0 used again: page 1 is now the least recently used
    assert cache(index, [4, 4])[1] == [(0, 1)]
    assert cache(index, [5, 5])[1] == [(0, 2)]
    assert cache(index, [6, 6])[1] == [(0, 0)]


def test_a_parent_left_as_a_leaf_keeps_its_old_recency():
    index = PrefixIndex(num_pages=3, page_size=1)
    cache(index, [1, 2, 3])  # pages 0, 1 (child of 0)
    cache(index, [4, 4])  # page 2
    # evicting leaf 1 leaves page 0 a leaf older than page 2, so page 0 is next
    assert cache(index, [5, 5])[1] == [(0, 1)]
    assert cache(index, [6, 6])[1] == [(0, 0)]
    assert index.acquire([4, 4]) == [2]


def test_referenced_pages_are_never_evicted_and_exhaustion_shortens_the_chain():
    index = PrefixIndex(num_pages=3, page_size=1)
    held = index.acquire([1, 2])
    assert index.store([1, 2], held) == [(0, 0)]
    held = index.acquire([1, 2])
    assert held == [0] and index.pages_referenced == 1
    # 2 free pages for 4 candidates: the chain stops after 2 contiguous pages
    have = index.acquire([7, 8, 9, 10, 11])
    written = index.store([7, 8, 9, 10, 11], have)
    assert written == [(0, 1), (1, 2)]
    index.check_invariants()
    # everything is referenced or on the chain being built: nothing can be stored
    also = index.acquire([7, 8, 9, 10, 11])
    assert also == [1, 2]
    assert index.store([7, 8, 9, 10, 11], also) == []
    assert index.store([5, 6, 7], index.acquire([5, 6, 7])) == []
    assert index.evictions == 0
    index.release(also)
    index.release(held)
    index.check_invariants()


def test_the_chain_being_built_is_not_evicted():
    index = PrefixIndex(num_pages=2, page_size=1)
    cache(index, [1, 1])  # page 0
    # the new chain evicts page 0 for its second page, but not its own first page for its third
    _, written = cache(index, [2, 2, 2, 2])
    assert written == [(0, 1), (1, 0)]
    # page 0 (a leaf) goes for the first page; then page 1, a leaf once its child is gone; then only the chain's
    # own pages are left
    _, written = cache(index, [3, 3, 3, 3, 3])
    assert written == [(0, 0), (1, 1)]
    assert index.acquire([3, 3, 3, 3, 3]) == [0, 1]
    index.check_invariants()


def test_store_keeps_a_have_page_left_unreferenced():
    index = PrefixIndex(num_pages=2, page_size=1)
    cache(index, [1, 1])  # page 0
    have = index.acquire([1, 1, 2])
    index.release(have)  # not how a caller should work, but the have chain must still not be evicted
    cache(index, [5, 5])  # page 1, used after page 0
    # page 0 is the least recently used leaf, but it is the chain's own: page 1 goes instead
    assert index.store([1, 1, 2], have) == [(1, 1)]
    assert index.acquire([1, 1, 2]) == [0, 1]
    index.check_invariants()


def test_release_errors():
    index = PrefixIndex(num_pages=2, page_size=1)
    cache(index, [1, 1])
    with pytest.raises(ValueError, match="page 0"):
        index.release([0])
    have = index.acquire([1, 1])
    with pytest.raises(ValueError, match="page 0"):
        index.release([0, 0])
    assert index.pages_referenced == 1  # a failed release changes nothing
    with pytest.raises(ValueError, match="page 5"):
        index.release([5])
    index.release(have)
    assert index.pages_referenced == 0


def test_stats():
    index = PrefixIndex(num_pages=2, page_size=3)
    assert index.stats() == {"hits": 0, "misses": 0, "hit_tokens": 0, "pages_cached": 0, "pages_referenced": 0,
                             "evictions": 0, "num_pages": 2, "page_size": 3}
    cache(index, list(range(7)))
    have = index.acquire(list(range(8)))
    assert have == [0, 1]
    cache(index, [9] * 4)
    assert index.stats() == {"hits": 1, "misses": 2, "hit_tokens": 6, "pages_cached": 2, "pages_referenced": 2,
                             "evictions": 0, "num_pages": 2, "page_size": 3}
    index.release(have)
    cache(index, [9] * 4)
    assert index.evictions == 1 and index.hits == 1 and index.misses == 3 and index.pages_referenced == 0


def test_disabled_index():
    index = PrefixIndex(num_pages=0, page_size=4)
    prompt = list(range(20))
    assert index.acquire(prompt) == []
    assert index.store(prompt, []) == []
    index.release([])
    assert index.stats()["misses"] == 1 and index.pages_cached == 0
    index.check_invariants()


class BruteForceIndex:
    """The same semantics by exhaustive search: a list of cached pages, eviction by scanning all of them."""

    def __init__(self, num_pages, page_size):
        self.num_pages, self.p = num_pages, page_size
        self.page_of_key = {}
        self.refs = {}
        self.last_used = {}
        self.next_free = 0
        self.clock = 0
        self.evictions = self.hits = self.misses = self.hit_tokens = 0

    def keys(self, tokens):
        """The token tuples of the prompt's candidate pages."""
        p = self.p
        return [tuple(tokens[i * p: (i + 1) * p + 1]) for i in range(len(tokens)) if (i + 1) * p < len(tokens)]

    def touch(self, page):
        self.clock += 1
        self.last_used[page] = self.clock

    def acquire(self, tokens):
        matched, parent = [], -1
        for page_tokens in self.keys(tokens):
            page = self.page_of_key.get((parent, page_tokens))
            if page is None:
                break
            matched.append(page)
            parent = page
        for page in matched:
            self.refs[page] += 1
            self.touch(page)
        self.hits += bool(matched)
        self.misses += not matched
        self.hit_tokens += len(matched) * self.p
        return matched

    def release(self, pages):
        for page in pages:
            self.refs[page] -= 1

    def store(self, tokens, have):
        keys = self.keys(tokens)
        chain = list(have)
        parent = have[-1] if have else -1
        written = []
        for i in range(len(have), len(keys)):
            key = (parent, keys[i])
            page = self.page_of_key.get(key)
            if page is None:
                if self.next_free < self.num_pages:
                    page = self.next_free
                    self.next_free += 1
                else:
                    parents = {k[0] for k in self.page_of_key}
                    leaves = [q for q in self.page_of_key.values()
                              if self.refs[q] == 0 and q not in parents and q not in chain]
                    if not leaves:
                        break
                    page = min(leaves, key=self.last_used.__getitem__)
                    del self.page_of_key[next(k for k, q in self.page_of_key.items() if q == page)]
                    self.evictions += 1
                self.page_of_key[key] = page
                self.refs[page] = 0
                written.append((i, page))
            self.touch(page)
            chain.append(page)
            parent = page
        return written

    def check(self, index):
        assert len(self.page_of_key) <= self.num_pages
        assert len(set(self.page_of_key.values())) == len(self.page_of_key)  # no page id held by two keys
        assert all(n >= 0 for n in self.refs.values())
        cached = set(self.page_of_key.values())
        for key, page in self.page_of_key.items():  # every cached page reachable: its parent is cached
            assert key[0] == -1 or key[0] in cached
        assert index.stats() == {
            "hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
            "pages_cached": len(self.page_of_key), "pages_referenced": sum(self.refs[q] > 0 for q in cached),
            "evictions": self.evictions, "num_pages": self.num_pages, "page_size": self.p}


@pytest.mark.parametrize("seed", range(24))
def test_random_prompts_against_brute_force(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 3, 4])
    num_pages = rng.choice([0, 1, 2, 3, 5, 8, 13])
    index, model = PrefixIndex(num_pages, page_size), BruteForceIndex(num_pages, page_size)
    vocab = rng.choice([2, 3])
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 4 * page_size + 1))] for _ in range(4)]
    pending = []  # acquired, not yet stored: (tokens, have)
    held = []  # stored, not yet released: have
    for _ in range(120):
        op = rng.random()
        if op < 0.45:
            tokens = rng.choice(bases) + [rng.randrange(vocab) for _ in range(rng.randrange(0, 3 * page_size + 2))]
            have = index.acquire(tokens)
            assert have == model.acquire(tokens)
            pending.append((tokens, have))
        elif op < 0.8 and pending:
            tokens, have = pending.pop(rng.randrange(len(pending)))
            written = index.store(tokens, have)
            assert written == model.store(tokens, have)
            held.append(have)
        elif held:
            have = held.pop(rng.randrange(len(held)))
            index.release(have)
            model.release(have)
        index.check_invariants()
        model.check(index)
    for _, have in pending:
        held.append(have)
    for have in held:
        index.release(have)
        model.release(have)
    assert index.pages_referenced == 0
    index.check_invariants()
    model.check(index)
