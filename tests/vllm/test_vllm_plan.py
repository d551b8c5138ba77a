"""The scheduler side's bookkeeping (``StepPlanner``) on plain data: what is looked up,
what is loaded into which blocks, what is published and when."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from kvcs.vllm.config import Role
from kvcs.vllm.plan import CachedRequest, Found, LoadSpec, NewRequest, SaveSpec, StepPlanner

B = 4


class Published:
    """A lookup that answers from a fixed published prefix and counts its calls."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, prefix: Sequence[int]) -> Future[Found]:
        self.calls.append(tuple(prefix))
        n = 0
        while (n + 1) * B <= min(len(prefix), len(self.tokens)) and list(
            prefix[: (n + 1) * B]
        ) == self.tokens[: (n + 1) * B]:
            n += 1
        done: Future[Found] = Future()
        done.set_result(Found(n, exact=n == len(prefix) // B))
        return done


PROMPT = tuple(range(100, 114))  # 14 tokens: 3 full blocks, 13 usable -> 3 blocks


def test_the_last_prompt_token_is_never_loaded() -> None:
    lookup = Published(range(100, 200))
    planner = StepPlanner(Role.CONSUMER, B, lookup)
    assert planner.matched("r", PROMPT, 0) == 12
    # a prompt of exactly 3 blocks: the last block holds the last token -> 2 blocks are
    # loaded; all 3 are looked up (and retrieved), so that the same prompt prefilled
    # elsewhere is found exactly
    assert planner.matched("s", tuple(range(100, 112)), 0) == 8
    assert lookup.calls[1] == tuple(range(100, 112))
    planner.allocated("s", 8)
    loads, _ = planner.build([NewRequest("s", tuple(range(100, 112)), (4, 5, 6), 8, 4)], [])
    assert loads == [LoadSpec("s", tuple(range(100, 112)), 0, (4, 5))]
    assert loads[0].blocks == 2


def test_the_lookup_runs_once_per_request_and_counts_local_blocks() -> None:
    lookup = Published(range(100, 200))
    planner = StepPlanner(Role.CONSUMER, B, lookup)
    assert planner.matched("r", PROMPT, 4) == 8  # one block computed locally already
    assert planner.matched("r", PROMPT, 4) == 8
    assert len(lookup.calls) == 1
    assert planner.matched("t", PROMPT, 12) == 0  # nothing beyond the local hit


def test_the_engine_is_asked_to_wait_while_the_lookup_runs() -> None:
    pending: Future[Found] = Future()
    asked: list[tuple[int, ...]] = []

    def lookup(prefix: Sequence[int]) -> Future[Found]:
        asked.append(tuple(prefix))
        return pending

    planner = StepPlanner(Role.CONSUMER, B, lookup)
    assert planner.matched("r", PROMPT, 0) is None
    assert planner.matched("r", PROMPT, 0) is None
    assert len(asked) == 1  # one question per request
    pending.set_result(Found(2))
    assert planner.matched("r", PROMPT, 0) == 8
    failed: Future[Found] = Future()
    failed.set_exception(TimeoutError())
    planner = StepPlanner(Role.CONSUMER, B, lambda prefix: failed)
    assert planner.matched("s", PROMPT, 0) == 0  # a failed lookup is a miss


def test_a_miss_or_a_partial_hit() -> None:
    planner = StepPlanner(Role.CONSUMER, B, Published([1, 2, 3, 4]))
    assert planner.matched("r", PROMPT, 0) == 0
    planner.allocated("r", 0)
    loads, saves = planner.build([NewRequest("r", PROMPT, (5, 6, 7, 8), 0, 14)], [])
    assert loads == [] and saves == []
    partial = StepPlanner(Role.CONSUMER, B, Published([*range(100, 108), 0, 0, 0, 0]))
    assert partial.matched("r", PROMPT, 0) == 8
    partial.allocated("r", 8)
    loads, _ = partial.build([NewRequest("r", PROMPT, (5, 6, 7, 8), 8, 6)], [])
    # 2 of the 3 candidate blocks: the load goes to the index at once
    assert loads == [LoadSpec("r", PROMPT[:8], 0, (5, 6), exact=False)]


def test_a_load_carries_the_prefix_and_its_block_ids() -> None:
    planner = StepPlanner(Role.CONSUMER, B, Published(range(100, 200)))
    assert planner.matched("r", PROMPT, 4) == 8
    planner.allocated("r", 8)
    loads, saves = planner.build([NewRequest("r", PROMPT, (9, 3, 7, 5), 12, 2)], [])
    assert loads == [LoadSpec("r", PROMPT[:12], 1, (9, 3, 7))]
    assert loads[0].blocks == 3
    assert saves == []  # a consumer never publishes
    planner.finished("r")
    assert planner.tracked == 0


def test_a_consumer_that_gets_fewer_tokens_than_offered() -> None:
    """vLLM may cut the external tokens (to 0, e.g. when the hit is too short to use)."""
    planner = StepPlanner(Role.CONSUMER, B, Published(range(100, 200)))
    planner.matched("r", PROMPT, 0)
    planner.allocated("r", 0)
    assert planner.build([NewRequest("r", PROMPT, (1, 2, 3, 4), 0, 14)], []) == ([], [])
    assert planner.tracked == 0


def test_a_producer_publishes_the_full_blocks_once_they_are_computed() -> None:
    lookup = Published([])
    planner = StepPlanner(Role.PRODUCER, B, lookup)
    assert planner.matched("r", PROMPT, 0) == 0 and lookup.calls == []  # never looks up
    planner.allocated("r", 0)
    loads, saves = planner.build([NewRequest("r", PROMPT, (4, 5, 6, 7), 0, 14)], [])
    assert loads == [] and saves == [SaveSpec("r", PROMPT[:12], (4, 5, 6))]
    # later decode steps publish nothing more
    assert planner.build([], [CachedRequest("r", None, False, 14, 1)]) == ([], [])


def test_chunked_prefill_publishes_at_the_last_chunk_with_every_block() -> None:
    planner = StepPlanner(Role.PRODUCER, B, Published([]))
    planner.matched("r", PROMPT, 0)
    planner.allocated("r", 0)
    _, saves = planner.build([NewRequest("r", PROMPT, (4, 5), 0, 8)], [])
    assert saves == []
    _, saves = planner.build([], [CachedRequest("r", (6,), False, 8, 2)])
    assert saves == []  # 10 of 12 tokens
    _, saves = planner.build([], [CachedRequest("r", (7,), False, 10, 4)])
    assert saves == [SaveSpec("r", PROMPT[:12], (4, 5, 6))]


def test_both_publishes_only_what_it_computed_beyond_the_load() -> None:
    planner = StepPlanner(Role.BOTH, B, Published(range(100, 200)))
    assert planner.matched("r", PROMPT, 0) == 12
    planner.allocated("r", 12)
    loads, saves = planner.build([NewRequest("r", PROMPT, (1, 2, 3, 4), 12, 2)], [])
    assert len(loads) == 1 and saves == []  # everything it has was loaded
    longer = (*range(100, 112), 7, 7, 7, 7, 7)  # 17 tokens: 4 full blocks, 3 loadable
    assert planner.matched("s", longer, 0) == 12
    planner.allocated("s", 12)
    loads, saves = planner.build([NewRequest("s", longer, (5, 6, 7, 8, 9), 12, 5)], [])
    assert [x.req_id for x in loads] == ["s"]
    assert saves == [SaveSpec("s", longer[:16], (5, 6, 7, 8))]


def test_a_preempted_request_loads_into_its_new_blocks() -> None:
    planner = StepPlanner(Role.CONSUMER, B, Published(range(100, 200)))
    planner.matched("r", PROMPT, 0)
    planner.allocated("r", 12)
    loads, _ = planner.build([], [CachedRequest("r", (8, 9, 10, 11), True, 12, 2)])
    assert loads == [LoadSpec("r", PROMPT[:12], 0, (8, 9, 10))]
