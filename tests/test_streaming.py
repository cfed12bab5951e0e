"""StepUpdate's thread sharing: the learner's worker lends the rollout engine its torch threads while it waits."""

import threading
import time
from types import SimpleNamespace

import torch

from conftest import SMALL_RUN
from tether.config import load_config
from tether.pipeline.streaming import StepUpdate


class _Accumulation:
    def __init__(self, lent):
        self.lent, self.seen, self.trajectories = lent, [], []
        self.gate = threading.Event()  # a group's training ends once it is set
        self.gate.set()

    def add_trajectories(self, trajs, adv):
        self.seen.append((torch.get_num_threads(), self.lent[-1]))  # the learner's threads and the engine's, meanwhile
        self.trajectories += trajs
        assert self.gate.wait(10)


class _Learner:
    streams = True

    def __init__(self, lent):
        self.update = _Accumulation(lent)
        self.finished = threading.Event()

    def begin_step(self):
        return self.update

    def finish_step(self, update):
        self.finished.set()


def _group(index):
    trajs = [SimpleNamespace(reward=float(i % 2)) for i in range(2)]
    return SimpleNamespace(index=index, dropped=False, group=SimpleNamespace(trajectories=trajs))


def _wait_for(condition):
    for _ in range(1000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_the_engine_and_the_learner_each_have_half_the_threads_for_the_whole_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_THREADS", "2")  # the step's count fixed: not lowered by the tests running beside it
    (tmp_path / "cfg.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "cfg.yaml"], ["rollout.mode=sync", "learner.overlap_rollout=true"])
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    lent = [2]  # the engine's threads, as StepUpdate sets them
    try:
        learner = _Learner(lent)
        with StepUpdate(learner, cfg.policy_optimization.advantage, overlap_rollout=cfg.learner.overlap_rollout,
                        mode=cfg.rollout.mode, ordered=cfg.trainer.deterministic, engine_threads=lent.append) as update:
            assert lent == [2, 1]  # from the step's start, before any group
            groups = [_group(i) for i in range(4)]
            update.offer(groups[0])
            _wait_for(lambda: len(learner.update.seen) == 1)  # trained beside the rollout, the learner waits
            learner.update.gate.clear()  # group 1 trains until group 2 is queued too
            update.offer(groups[1])
            update.offer(groups[2])
            learner.update.gate.set()
            _wait_for(lambda: len(learner.update.seen) == 3)
            trajs = [t for g in groups for t in g.group.trajectories]
            assert update.train(groups, trajs, torch.zeros(len(trajs)))  # group 3: left after the rollout
        assert learner.finished.is_set()
        # each group on one thread, the one left after the rollout too, the engine on the other until the rollout ends
        assert learner.update.seen == [(1, 1)] * 3 + [(1, 2)]
        assert lent == [2, 1, 2, 2] and torch.get_num_threads() == 2  # the caller's count back when the rollout ends
    finally:
        torch.set_num_threads(saved)


def test_each_group_advantages_are_computed_once_and_are_the_whole_batch_ones(tmp_path, monkeypatch, metrics):
    from tether.pipeline import streaming

    (tmp_path / "cfg.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "cfg.yaml"], ["rollout.mode=sync", "learner.overlap_rollout=true"])
    calls = []
    real = streaming.group_advantages

    def counted(rewards, **kw):
        calls.append(len(rewards))
        return real(rewards, **kw)

    monkeypatch.setattr(streaming, "group_advantages", counted)
    rewards = [[0.1, 0.7, 0.3], [1.0, 1.0, 1.0], [0.2, 0.9, 0.0]]  # group 1 is degenerate (one of three)
    groups = [SimpleNamespace(index=i, dropped=False, group=SimpleNamespace(
        trajectories=[SimpleNamespace(reward=r) for r in rs])) for i, rs in enumerate(rewards)]
    learner = _Learner([2])
    with StepUpdate(learner, cfg.policy_optimization.advantage, overlap_rollout=True, mode="sync", ordered=True) as up:
        up.offer(groups[0])
        _wait_for(lambda: len(learner.update.trajectories) == 3)  # group 0 trained as it finished: its advantages
        trajs, adv = up.advantages(groups)  # groups 1 and 2 now, group 0's reused
        assert up.train(groups, trajs, adv)
    assert calls == [3, 3, 3]  # one computation per group, none for the batch
    whole, m = real(torch.tensor([r for rs in rewards for r in rs]).double(), group_sizes=[3, 3, 3],
                     normalization="group")
    assert torch.equal(adv, whole.float())  # the values the whole batch gives, bit for bit
    row = metrics.flush(1)
    assert row["optim/advantage_std"] == float(m["advantage_std"])
    assert row["optim/degenerate_group_ratio"] == float(m["degenerate_group_ratio"]) == float(torch.tensor(1 / 3))
    assert row["optim/nonzero_advantage_ratio"] == float(torch.tensor(6 / 9))  # the degenerate group's 3 are 0


class _PartsUpdate(_Accumulation):
    def __init__(self, lent):
        super().__init__(lent)
        self.parts = []

    def add_parts(self, parts, workers, threads):
        self.parts.append((len(parts), workers, threads))
        for trajs, adv in parts:
            self.add_trajectories(trajs, adv)


def _left_after_the_rollout(cfg, mode, ordered, concurrent=True):
    """A step of 3 groups, all finished as the rollout ends (none offered): how the learner was asked to add them."""
    learner = _Learner([2])
    learner.concurrent_adds = concurrent
    learner.update = _PartsUpdate([2])
    groups = [_group(i) for i in range(3)]
    with StepUpdate(learner, cfg.policy_optimization.advantage, overlap_rollout=True, mode=mode, ordered=ordered,
                    engine_threads=[2].append) as update:
        trajs = [t for g in groups for t in g.group.trajectories]
        assert update.train(groups, trajs, torch.zeros(len(trajs)))
    assert learner.finished.is_set() and len(learner.update.trajectories) == 6
    return learner.update.parts


def test_the_groups_left_after_a_sync_rollout_are_added_two_at_a_time(tmp_path, monkeypatch):
    """The engine idles once a sync rollout ends: its half of the threads trains groups too (two threads add groups
    at once, each on half); not in deterministic mode (which groups are left follows timing), nor in the async modes
    (the engine goes on generating), nor for a learner that adds one group at a time (a ``LearnerGroup``)."""
    monkeypatch.setenv("TETHER_THREADS", "2")
    (tmp_path / "cfg.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "cfg.yaml"], [])
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _left_after_the_rollout(cfg, "sync", False) == [(3, 2, 1)]
        assert _left_after_the_rollout(cfg, "sync", True) == []  # one by one, on the worker's half
        assert _left_after_the_rollout(cfg, "fully_async", False) == []
        assert _left_after_the_rollout(cfg, "sync", False, concurrent=False) == []
    finally:
        torch.set_num_threads(saved)
