"""The trace-safe KV write (model._KVPlan) against a brute-force model of the cache, as hypothesis properties.

A run is a sequence of chunks (bucket size T, n <= T valid rows) fed at consecutive positions, as greedy_generate
does. Each key row carries its position + 1 as its value, so after every chunk the buffer content and the
attention mask can be compared with what a position-by-position cache would hold:
    full layer (S slots):   slot p holds position p once written; a query at q sees exactly positions 0..q
    sliding layer (ring R): slot j holds the latest written position = j mod R; a query at q sees exactly
                            positions max(0, q - W + 1)..q, wherever they sit (old ring or this chunk)
Padding rows (t >= n) must never reach the buffer.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_backend.config import FULL, SLIDING
from neuron_backend.model import _KVPlan

chunks = st.lists(st.tuples(st.integers(1, 7), st.integers(1, 7)), min_size=1, max_size=6).map(
    lambda cs: [(t, min(n, t)) for t, n in cs]
)


def _feed(kind, slots, window, schedule):
    cache = torch.zeros(1, 1, slots, 1)
    start = 0
    for t, n in schedule:
        pos = start + torch.arange(t)[None]
        tok_valid = torch.arange(t)[None] < n
        plan = _KVPlan(kind, slots, window, pos, torch.tensor([start]), torch.tensor([n]), tok_valid)
        new = (pos + 1).float().where(tok_valid, torch.tensor(-1.0))[:, None, :, None]  # pads carry -1
        (keys, _), (cache, _) = plan.update(cache, cache, new, new)
        yield start, t, n, plan, keys, cache
        start += n


@settings(max_examples=60, deadline=None)
@given(schedule=chunks, window=st.integers(1, 6))
def test_sliding_ring_matches_brute_force(schedule, window):
    ring = window  # BuildSettings.kv_len: min(window, max_seq); the window is the smaller one here
    for start, t, n, plan, keys, cache in _feed(SLIDING, ring, window, schedule):
        end = start + n  # positions < end are written
        for j in range(ring):
            held = [p for p in range(end) if p % ring == j]
            assert cache[0, 0, j, 0].item() == (held[-1] + 1 if held else 0)
        for row in range(n):
            q = start + row
            seen = sorted(int(keys[0, 0, k, 0].item()) - 1 for k in range(keys.shape[2]) if plan.mask[0, 0, row, k])
            assert seen == list(range(max(0, q - window + 1), q + 1))


@settings(max_examples=60, deadline=None)
@given(schedule=chunks)
def test_full_buffer_matches_brute_force(schedule):
    slots = sum(n for _, n in schedule) + 7  # room for the last chunk's padding rows too
    for start, t, n, plan, keys, cache in _feed(FULL, slots, 0, schedule):
        end = start + n
        expect = [p + 1 if p < end else 0 for p in range(slots)]
        assert cache[0, 0, :, 0].tolist() == expect  # padding rows never written
        for row in range(n):
            q = start + row
            seen = [int(keys[0, 0, k, 0].item()) - 1 for k in range(slots) if plan.mask[0, 0, row, k]]
            assert seen == list(range(q + 1))
