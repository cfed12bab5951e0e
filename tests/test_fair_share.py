"""Fair admission across request groups (tether.engine.fair_share) and the LocalEngine's interruptions.

The policy's decisions are checked on hand-built queues; the engine's on the tests' tiny model: a group holding
every slot is interrupted for a later group's request, which then finishes while the first group is still running,
and every interrupted request resumes to the tokens it gets without contention (the same seeded draws; logprobs
within float noise: the resumed step's logits come from a prefill, not a decode). Requests without a group are
admitted first come, first served, as before.

The latency cap (``latency_rows``): while a small group's request waits or runs, the large groups decode at most that
many rows, and get their rows back once it has finished; requests without a group are never capped.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from dataclasses import dataclass

import pytest

from tether.engine.base import SamplingParams
from tether.engine.fair_share import large_groups, next_index, over_cap, share, victims
from tether.engine.local import LocalEngine
from tether.learner.model import load_model_and_tokenizer


@dataclass(eq=False)
class Req:
    group: object
    cancelled: bool = False


def solo() -> Req:
    """A request without a group, as the engine holds one: its own group."""
    r = Req(None)
    r.group = r
    return r


def test_share_and_the_next_request_is_the_first_of_the_group_running_fewest():
    assert (share(3, 8), share(0, 8), share(20, 8)) == (2, 8, 1)
    queue = [Req("a"), Req("a"), Req("b"), Req("c")]
    assert next_index(queue, Counter({"a": 3, "b": 1, "c": 1})) == 2  # b and c tie: b came first
    assert next_index(queue, Counter({"a": 3, "b": 2, "c": 1})) == 3
    assert next_index(queue, Counter()) == 0  # nobody running: first come, first served


def test_victims_are_taken_from_the_groups_above_their_share_only():
    running = [Req("heavy") for _ in range(6)] + [Req("mid"), Req("mid")]
    # 8 slots, all taken; 3 groups -> share 2. One small request waits: one heavy request (the latest) goes.
    small = [Req("small")]
    assert victims(small, running, 8) == [running[5]]
    # three small requests wait: small is entitled to 2 -> two heavy ones go, mid (at its share) keeps its 2
    assert victims([Req("small") for _ in range(3)], running, 8) == [running[5], running[4]]
    # a free slot for the one waiting: nobody is interrupted
    assert victims(small, running[1:], 8) == []
    # two groups -> share 4: mid, below it, takes one of heavy's; at its share it interrupts nobody
    assert victims([Req("mid")], running, 8) == [running[5]]
    even = [Req("heavy") for _ in range(4)] + [Req("mid") for _ in range(4)]
    assert victims([Req("mid"), Req("heavy")], even, 8) == []
    # requests of groups of one (rollouts): nothing to interrupt
    singles = [Req(str(i)) for i in range(8)]
    assert victims([Req("x")], singles, 8) == []
    assert victims([Req("small", cancelled=True)], running, 8) == []


def test_next_index_passes_over_blocked_groups():
    queue = [Req("a"), Req("b"), Req("a")]
    assert next_index(queue, Counter({"b": 1}), blocked={"a"}) == 1  # b runs more, but a is blocked
    assert next_index([Req("a")], Counter(), blocked={"a"}) == -1


def test_the_latency_cap_holds_the_large_groups_while_a_small_one_is_queued_or_running():
    heavy = [Req("heavy") for _ in range(6)] + [Req("mid") for _ in range(3)]
    # a small group (1 request <= 4 rows) queued: heavy (6) and mid (3 running + 2 queued = 5) are large
    queue = [Req("small"), Req("mid"), Req("mid")]
    assert large_groups(queue, heavy, 4) == ({"heavy", "mid"}, True)
    # 9 rows of large groups, 4 allowed: 5 go, taken from the group holding most, its latest first
    # (heavy 6 -> 5 -> 4 -> 3, then mid 3 and heavy 3 tie: most_common keeps heavy, then mid)
    assert over_cap(heavy, {"heavy", "mid"}, 4) == [heavy[5], heavy[4], heavy[3], heavy[2], heavy[8]]
    assert over_cap(heavy[:4], {"heavy"}, 4) == []
    # no small group: no cap; a cancelled small request is no small group
    assert large_groups([Req("mid"), Req("mid")], heavy, 4) == ({"heavy", "mid"}, False)  # mid: 3 running + 2 queued
    assert large_groups([Req("small", cancelled=True)], heavy[:6], 4) == ({"heavy"}, False)
    # the small group running (nothing queued) keeps the cap on
    assert large_groups([], [*heavy, Req("small")], 4) == ({"heavy"}, True)
    # requests without a group are neither small nor large: rollouts are never capped
    singles = [solo() for _ in range(8)]
    assert large_groups([solo()], singles, 4) == (set(), False)
    assert large_groups([Req("small")], [*singles, *heavy[:6]], 4) == ({"heavy"}, True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model_and_tokenizer(tiny_model)[0]


PROMPT, OTHER = list(range(5, 45)), list(range(60, 75))


def test_a_full_batch_is_interrupted_for_a_later_group_and_everyone_gets_their_uncontended_tokens(model):
    heavy = [SamplingParams(temperature=1.0, max_tokens=150, seed=i) for i in range(8)]
    small = SamplingParams(temperature=1.0, max_tokens=8, seed=99)

    async def contended(engine):
        tasks = [asyncio.ensure_future(engine.generate(PROMPT, p, group="heavy")) for p in heavy]
        while engine.stats["generated_tokens"] < 8:  # the heavy group holds every slot (150 tokens each)
            await asyncio.sleep(0.001)
        result = await engine.generate(OTHER, small, group="small")
        unfinished = sum(not t.done() for t in tasks)
        return result, unfinished, await asyncio.gather(*tasks)

    async def alone(engine):
        return (await engine.generate(OTHER, small),
                await asyncio.gather(*(engine.generate(PROMPT, p) for p in heavy)))

    with LocalEngine(copy.deepcopy(model), max_batch=8) as engine:
        got_small, unfinished, got_heavy = asyncio.run(contended(engine))
        interruptions = engine.stats["fair_interruptions"]
    with LocalEngine(copy.deepcopy(model), max_batch=8) as engine:
        want_small, want_heavy = asyncio.run(alone(engine))
    assert interruptions >= 1 and unfinished >= 7  # the small request did not wait for the heavy group to end
    assert sum(r.num_preempted for r in got_heavy) == interruptions
    for got, want in [(got_small, want_small), *zip(got_heavy, want_heavy)]:
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_requests_without_a_group_wait_first_come_first_served(model):
    params = [SamplingParams(temperature=0.0, max_tokens=40 if i < 4 else 4) for i in range(6)]

    async def run(engine):
        order: list[int] = []

        async def one(i):
            await engine.generate(PROMPT, params[i])
            order.append(i)

        await asyncio.gather(*(one(i) for i in range(6)))
        return order

    with LocalEngine(copy.deepcopy(model), max_batch=4) as engine:
        order = asyncio.run(run(engine))
        assert engine.stats["fair_interruptions"] == 0
    assert set(order[:4]) == {0, 1, 2, 3}  # the two short ones waited for a free slot: no interruption


def capped_run(model, grouped: bool):
    """12 heavy requests (one group, 120 tokens) take 12 of 16 slots; a small request (8 tokens) comes once they all
    run. Returns the heavy rows of every decode step before the small request is sent, while it runs (decoded beside
    them) and after it was sent but not running, the results (small, heavy) and the engine's stats."""
    heavy = [SamplingParams(temperature=1.0, max_tokens=120, seed=i) for i in range(12)]
    small = SamplingParams(temperature=1.0, max_tokens=8, seed=99)
    rows: dict[str, list[int]] = {"before": [], "during": [], "after": []}
    phase = ["before"]

    with LocalEngine(copy.deepcopy(model), max_batch=16, latency_rows=4) as engine:
        decode = engine._runner.decode

        def watched(inputs, **kw):  # on the worker thread, before each decode forward
            running = engine._slots.running
            small_runs = any(r.params.max_tokens == 8 for r in running)
            rows["during" if small_runs else phase[0]].append(sum(r.params.max_tokens == 120 for r in running))
            return decode(inputs, **kw)

        engine._runner.decode = watched

        async def run():
            kw = {"group": "heavy"} if grouped else {}
            tasks = [asyncio.ensure_future(engine.generate(PROMPT, p, **kw)) for p in heavy]
            while engine.stats["generated_tokens"] < 36:  # every heavy request runs
                await asyncio.sleep(0.001)
            phase[0] = "after"
            got = await engine.generate(OTHER, small, **({"group": "small"} if grouped else {}))
            return got, await asyncio.gather(*tasks)

        got_small, got_heavy = asyncio.run(run())
        stats = dict(engine.stats)
    return rows, got_small, got_heavy, stats


def test_the_latency_cap_parks_a_large_groups_rows_while_a_small_request_runs(model):
    rows, got_small, got_heavy, stats = capped_run(model, grouped=True)
    before = rows["before"]  # a large group is admitted latency_rows (4) a step: 4, 8, 12 when all came at once
    assert before[0] <= 4 and all(b - a <= 4 for a, b in zip(before, before[1:])) and before[-1] == 12
    assert len(rows["during"]) >= 7 and max(rows["during"]) <= 4
    assert max(rows["after"]) == 12  # the heavy group gets its rows back once the small request has ended
    assert stats["latency_parked"] >= 8 and stats.get("fair_interruptions", 0) == 0
    assert sum(r.num_preempted for r in got_heavy) == stats["latency_parked"]
    # everyone gets the tokens they get without contention (seeded draws; parked caches resumed)
    with LocalEngine(copy.deepcopy(model), max_batch=16) as engine:
        async def alone():
            return (await engine.generate(OTHER, SamplingParams(temperature=1.0, max_tokens=8, seed=99)),
                    await asyncio.gather(*(engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=120,
                                                                                  seed=i)) for i in range(12))))
        want_small, want_heavy = asyncio.run(alone())
    for got, want in [(got_small, want_small), *zip(got_heavy, want_heavy)]:
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_the_latency_cap_leaves_requests_without_a_group_alone(model):
    rows, _, got_heavy, stats = capped_run(model, grouped=False)
    assert min(rows["during"]) == 12  # none parked
    assert stats.get("latency_parked", 0) == 0 and all(r.num_preempted == 0 for r in got_heavy)
