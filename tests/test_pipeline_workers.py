"""rollout.worker.num_workers: at most that many environment steps run at once, across episodes and loops."""

import asyncio

import pytest

from tether.pipeline.rollouter import PooledEnv, WorkerPool


class SlowEnv:
    verifier = None
    running = 0
    peak = 0

    async def astep(self, action):
        SlowEnv.running += 1
        SlowEnv.peak = max(SlowEnv.peak, SlowEnv.running)
        await asyncio.sleep(0.01)
        SlowEnv.running -= 1
        return {"last_tool_result": action["name"]}, 0.0, False, {}

    def system_prompt(self):
        return "be helpful"


@pytest.mark.parametrize("workers, expected_peak", [(1, 1), (3, 3), (64, 12)])
def test_pool_bounds_concurrent_env_steps(workers, expected_peak):
    pool = WorkerPool(workers)

    async def episode(i):
        env = PooledEnv(SlowEnv(), pool)
        return [await env.astep({"name": f"tool{i}", "params": {}}) for _ in range(2)]

    async def batch():
        return await asyncio.wait_for(asyncio.gather(*(episode(i) for i in range(12))), 5)

    for _ in range(2):  # a fresh event loop each time (sync mode runs one asyncio.run per batch)
        SlowEnv.peak = 0
        out = asyncio.run(batch())
        assert SlowEnv.peak == expected_peak and SlowEnv.running == 0
        assert out[5][1][0] == {"last_tool_result": "tool5"}
    assert PooledEnv(SlowEnv(), pool).system_prompt() == "be helpful"  # the rest is the env's own


def test_pool_rejects_zero_workers():
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        WorkerPool(0)
