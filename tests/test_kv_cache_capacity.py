"""The cache capacities the engine allocates (model.kv_cache.round_capacity)."""

from model.kv_cache import CAPACITY_MULTIPLE, LONG_CAPACITY, LONG_CAPACITY_MULTIPLE, round_capacity


def test_capacity_covers_the_slots_in_whole_blocks():
    for slots in (1, 63, 64, 65, 1040, 4095, 4096, 4097, 32784, 131072 + 300):
        cap = round_capacity(slots)
        multiple = LONG_CAPACITY_MULTIPLE if slots > LONG_CAPACITY else CAPACITY_MULTIPLE
        assert slots <= cap < slots + multiple and cap % multiple == 0, (slots, cap)
    # long caches: whole 64 x 8 chunks for XLA's split context GEMM (no per-step pad of the cache)
    assert round_capacity(32768 + 16) == 33280 and round_capacity(1024 + 16) == 1088
