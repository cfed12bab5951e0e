"""tether.threads: the thread count from the cores other processes leave, TETHER_THREADS, and its two users (SFT
gives the caller's count back; a training step adapts, except with trainer.deterministic, where counts stay pinned)."""

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import SMALL_RUN
from tether import threads
from tether.config import load_config
from tether.learner.model import load_model_and_tokenizer
from tether.learner.sft import sft
from tether.pipeline import streaming
from tether.threads import CpuReading, TorchThreads, choose, decide, others_busy
from tether.types import Trajectory


@pytest.fixture
def caller_threads():
    """torch at 2 threads for the test (the caller's count), its own count back after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(saved)


class Load:
    """A CpuMeter stand-in: ``others`` cores busy with other processes, of ``cpus``."""

    def __init__(self, others: float, cpus: int = 2):
        self.others, self.cpus = others, set(range(cpus))

    def look(self):
        return len(self.cpus) - self.others, self.others


@pytest.mark.parametrize("available, ceiling, expected", [
    (2.0, 2, 2),  # quiet
    (1.33, 2, 1),  # 2 threads beside one busy process: the scheduler gives it 2/3 of a core, 2 - 0.67 left
    (1.0, 2, 1),  # 1 thread beside it: it keeps its whole core
    (1.5, 2, 2),  # a process busy half the time: half a core still pays for a thread
    (1.49, 2, 1),
    (0.3, 2, 1),  # floor(0.8) = 0: never below one thread
    (3.7, 2, 2),  # never above the caller's count
    (6.6, 16, 7),  # floor(7.1)
])
def test_decide_rounds_the_available_cores_half_up_between_one_and_the_ceiling(available, ceiling, expected):
    assert decide(available, ceiling) == expected


def test_cores_busy_with_others_are_the_busy_seconds_less_this_process_own():
    before = CpuReading(t=10.0, busy=100.0, own=5.0)
    # 0.5 s: the CPUs were busy 0.9 s, 0.4 s of it this process's -> 0.5 s of others' in 0.5 s = 1 core
    assert others_busy(before, CpuReading(t=10.5, busy=100.9, own=5.4)) == pytest.approx(1.0)
    # this process alone (1.5 s busy, 1.5 s its own): nobody else
    assert others_busy(before, CpuReading(t=11.0, busy=101.5, own=6.5)) == 0.0
    # jiffies and process time tick apart: a negative difference reads as 0
    assert others_busy(before, CpuReading(t=11.0, busy=101.0, own=6.1)) == 0.0


def test_proc_stat_is_read_for_this_process_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 300 5000 10 0 0 0 0 0\n"
                    "cpu0 100 20 50 2000 5 3 2 10 0 0\n"  # busy: 100 + 20 + 50 + 3 + 2 + 10 = 185 jiffies
                    "cpu1 800 0 250 3000 5 0 0 0 40 0\n"  # 1050 (guest 40 is inside user already)
                    "cpu2 5 0 5 100\n"  # not this process's; an old kernel's four columns
                    "intr 12345\n\nprocs_running 3\n")
    tick = threads._CLK_TCK
    assert threads.read_cpus({0}, stat).busy == pytest.approx(185 / tick)
    assert threads.read_cpus({0, 1}, stat).busy == pytest.approx(1235 / tick)
    assert threads.read_cpus({1, 2}, stat).busy == pytest.approx(1060 / tick)
    assert threads.read_cpus({0}, tmp_path / "absent") is None


def test_cgroup_quota_in_cores(tmp_path):
    assert threads.parse_cpu_max("200000 100000\n") == 2.0
    assert threads.parse_cpu_max("150000 100000") == 1.5
    assert threads.parse_cpu_max("max 100000") is None
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("50000 100000\n")
    assert threads.quota_cores(v2) == 0.5
    v1 = tmp_path / "v1" / "cpu,cpuacct"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.quota_cores(v1.parent) is None
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    assert threads.quota_cores(v1.parent) == 3.0
    assert threads.quota_cores(tmp_path / "none") is None


def test_the_meter_on_this_machine_sees_a_busy_process_beside_it():
    """Loosely (other tests may run beside this one): readings within the machine, and a CPU-bound child counted
    as another process's load while this one sleeps."""
    meter = threads.CpuMeter(quota=lambda: None)
    available, others = meter.look()  # a fresh 0.2 s sample
    assert 0.0 <= others <= len(meter.cpus) + 0.2 and available == pytest.approx(len(meter.cpus) - others)
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        meter.look()
        time.sleep(0.5)
        available, others = meter.look()  # the window since the previous look
    finally:
        child.kill()
        child.wait()
    assert others >= 0.5
    assert threads.CpuMeter(quota=lambda: 0.5).look()[0] <= 0.5  # a cgroup quota caps what is available


def test_tether_threads_fixes_the_count(monkeypatch):
    monkeypatch.setenv("TETHER_THREADS", "3")
    assert choose(2, Load(others=1.9)) == threads.Choice(3, "TETHER_THREADS=3")  # neither the load nor the ceiling
    monkeypatch.setenv("TETHER_THREADS", "")
    assert threads.fixed_threads() is None and choose(2, Load(others=1.9)).threads == 1
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv("TETHER_THREADS", bad)
        with pytest.raises(ValueError, match=f"TETHER_THREADS={bad!r}: expected a positive number"):
            threads.fixed_threads()


def test_a_cgroup_quota_caps_the_count_and_says_so():
    class Quota(Load):
        def look(self):
            return 1.2, 0.0

    assert choose(2, Quota(others=0.0)) == threads.Choice(1, "about 0.0 of 2 cores are busy with other processes, "
                                                             "and a CPU quota allows 1.2")


def test_one_thread_asked_for_is_not_measured():
    class Unread:
        def look(self):
            raise AssertionError("measured")

    assert choose(1, Unread()) == threads.Choice(1, "one thread asked for")


def test_torch_threads_logs_each_change_and_gives_the_caller_count_back(caller_threads, monkeypatch):
    monkeypatch.delenv("TETHER_THREADS", raising=False)
    lines = []
    chooser = TorchThreads(lines.append)
    chooser.meter = Load(others=0.9)
    with chooser:
        assert chooser.update() == 1 and torch.get_num_threads() == 1
        assert chooser.update() == 1  # unchanged: no second line
    assert torch.get_num_threads() == caller_threads
    with chooser:  # a build's next phase begins at the caller's count: lowered again, no line for it
        assert chooser.update() == 1 and torch.get_num_threads() == 1
        chooser.meter = Load(others=0.1)
        assert chooser.update() == 2 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == caller_threads and chooser.counts == [1, 1, 1, 2]
    assert lines == ["2 → 1 torch threads: about 0.9 of 2 cores are busy with other processes",
                     "1 → 2 torch threads: about 0.1 of 2 cores are busy with other processes"]


def test_sft_trains_on_the_chosen_count_and_gives_the_caller_count_back(tiny_model, caller_threads, monkeypatch):
    monkeypatch.setenv("TETHER_THREADS", "1")
    model, tokenizer = load_model_and_tokenizer(tiny_model)
    ids = tokenizer.encode("the order O-3410 was refunded")
    n = len(ids) - 3
    trajs = [Trajectory(task_id=str(i), prompt_ids=ids[:3], response_ids=ids[3:], response_mask=[1] * n,
                        logprobs=[0.0] * n, versions=[0] * n) for i in range(4)]
    seen, lines = [], []
    model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    sft(model, trajs, pad_id=tokenizer.pad_token_id, epochs=2, batch_size=2, log=lines.append)
    assert seen == [1] * 4 and torch.get_num_threads() == caller_threads  # 2 epochs × 2 batches on 1, then 2 again
    assert lines[0] == "2 → 1 torch threads: TETHER_THREADS=1" and len(lines) == 3  # and the two epoch lines
    with pytest.raises(RuntimeError, match="interrupted"):  # an error too gives the count back

        def interrupted(traj, rng):
            raise RuntimeError("interrupted")

        sft(model, trajs, pad_id=tokenizer.pad_token_id, epochs=1, augment=interrupted)
    assert torch.get_num_threads() == caller_threads


class _Update:
    def __init__(self):
        self.seen = []

    def add_trajectories(self, trajs, adv):
        self.seen.append(torch.get_num_threads())


class _Learner:
    streams = True

    def __init__(self):
        self.update = _Update()

    def begin_step(self):
        return self.update

    def finish_step(self, update):
        update.seen.append(("finish", torch.get_num_threads()))


def _step(cfg, ordered, lent):
    """One streamed step whose single group is trained after the rollout; the engine's counts go to ``lent``."""
    learner = _Learner()
    group = SimpleNamespace(index=0, dropped=False, group=SimpleNamespace(
        trajectories=[SimpleNamespace(reward=0.0), SimpleNamespace(reward=1.0)]))
    with streaming.StepUpdate(learner, cfg.policy_optimization.advantage, overlap_rollout=True, mode="sync",
                              ordered=ordered, engine_threads=lent.append) as update:
        counts = (update.ceiling, update.all_threads, update.threads)
        trajs, adv = update.advantages([group])
        assert update.train([group], trajs, adv)
    return counts, learner.update.seen


def test_a_step_adapts_to_the_load_unless_deterministic(caller_threads, monkeypatch, tmp_path):
    (tmp_path / "cfg.yaml").write_text(SMALL_RUN)  # advantages normalised per group: the step streams
    cfg = load_config([tmp_path / "cfg.yaml"], [])
    monkeypatch.delenv("TETHER_THREADS", raising=False)
    monkeypatch.setattr(streaming, "_METER", Load(others=1.0))  # one core busy with another process
    lent: list[int] = []
    assert _step(cfg, False, lent) == ((2, 1, 1), [1, ("finish", 1)])  # the step on 1 thread, the engine too
    assert lent == [1, 2, 2] and torch.get_num_threads() == caller_threads  # the caller's back after the step
    lent.clear()
    # deterministic: the caller's 2, split (the engine on 1 until the rollout ends, every group on the other 1)
    assert _step(cfg, True, lent) == ((2, 2, 1), [1, ("finish", 2)])
    assert lent == [1, 2, 2] and torch.get_num_threads() == caller_threads
    monkeypatch.setattr(streaming, "_METER", Load(others=0.0))  # quiet: the caller's 2, split the same way
    lent.clear()
    assert _step(cfg, False, lent) == ((2, 2, 1), [1, ("finish", 2)]) and lent == [1, 2, 2]


def test_a_marked_meter_looks_back_to_the_mark_without_waiting(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(threads.time, "sleep", slept.append)
    assert threads.CpuMeter(quota=lambda: None).look() is not None
    assert slept == [threads.SAMPLE_S]  # no window yet: a sample, waited for at the look
    slept.clear()
    meter = threads.CpuMeter(quota=lambda: None)
    meter.mark()
    end = time.monotonic() + threads.MIN_WINDOW_S + 0.05
    while time.monotonic() < end:  # this process's own work: not taken for the others' load
        pass
    available, others = meter.look()
    assert slept == []  # the window since the mark: nothing to wait for
    assert 0.0 <= others <= len(meter.cpus) + 0.2 and available == pytest.approx(len(meter.cpus) - others)


def test_a_run_marks_its_start_so_its_first_step_does_not_wait_for_a_sample(tiny_model, caller_threads,
                                                                            monkeypatch, tmp_path):
    from tether.pipeline.trainer import train

    windows: list[bool] = []  # at each step's look: whether a window was open already

    class Meter(threads.CpuMeter):
        def look(self):
            windows.append(self._last is not None)
            return super().look()

    monkeypatch.delenv("TETHER_THREADS", raising=False)
    monkeypatch.setattr(streaming, "_METER", Meter())
    (tmp_path / "cfg.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "cfg.yaml"], ["trainer.total_steps=2"])
    train(cfg, tmp_path / "run", model_dir=tiny_model, show_progress=False)
    assert windows == [True, True]
