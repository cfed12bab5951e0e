"""The anti-hacking detectors' rule boundaries (tether.env.anti_hacking), calibrated on tau2's gold trajectories:
a stale repeat (within ``repeat_window``, the state unchanged since), a loop (more than ``max_repeats`` repeats),
and stuffing as numbers *listed* one after another. Every expectation below is counted by hand."""

from __future__ import annotations

import pytest

from tether.config import EnvironmentConfig, RunConfig
from tether.config.environment import AntiHackingConfig
from tether.env.anti_hacking import HackingDetector, is_stuffed, listed_numbers


def flags_of(det, calls, writes=()):
    """Each call's patterns; after the calls at the indexes in ``writes`` the environment reports a write."""
    out = []
    for i, (name, params) in enumerate(calls):
        out.append(det.observe(name, params))
        if i in writes:
            det.state_changed()
    return out


A, B, C = ("get", {"id": "A"}), ("get", {"id": "B"}), ("get", {"id": "C"})
W = ("cancel", {"id": "A"})


def test_a_repeat_within_the_window_is_stale_one_further_back_a_re_check():
    det = HackingDetector(patterns=["repeated_tool_calls"])  # repeat_window 2, max_repeats 2
    # A again 2 calls later: its answer still in view → flagged; A again 3 calls later (after B, C): a re-check
    assert flags_of(det, [A, B, A]) == [[], [], ["repeated_tool_calls"]]
    det = HackingDetector(patterns=["repeated_tool_calls"])
    assert flags_of(det, [A, B, C, A]) == [[], [], [], []]
    # repeat_window 3 reaches it: the pattern of the old default (4), where tau2's retail 21 was flagged
    det = HackingDetector(patterns=["repeated_tool_calls"], repeat_window=3)
    assert flags_of(det, [A, B, C, A]) == [[], [], [], ["repeated_tool_calls"]]
    # identical calls in one turn (parallel) are one call apart: flagged
    det = HackingDetector(patterns=["repeated_tool_calls"])
    assert flags_of(det, [A, A, A]) == [[], ["repeated_tool_calls"], ["repeated_tool_calls"]]


def test_a_read_after_a_reported_write_is_not_a_stale_repeat():
    # A, cancel A (a write the environment reports), A: the state changed, re-reading it confirms the write
    det = HackingDetector(patterns=["repeated_tool_calls"])
    assert flags_of(det, [A, W, A], writes={1}) == [[], [], []]
    # the same calls where the cancel changed nothing (it failed, or the env does not report writes): stale
    det = HackingDetector(patterns=["repeated_tool_calls"])
    assert flags_of(det, [A, W, A]) == [[], [], ["repeated_tool_calls"]]
    # after the write, a second read of A right away is stale again (same state as the first re-read)
    det = HackingDetector(patterns=["repeated_tool_calls"])
    assert flags_of(det, [A, W, A, A], writes={1}) == [[], [], [], ["repeated_tool_calls"]]


def test_more_than_max_repeats_is_a_loop_whatever_changed():
    cycle = [A, B, C] * 3 + [A]  # A made 4 times (3 repeats), B and C 3 times (2 repeats), 3 calls apart
    det = HackingDetector(patterns=["repeated_tool_calls"])  # max_repeats 2: only A's third repeat
    assert [i for i, f in enumerate(flags_of(det, cycle)) if f] == [9]
    det = HackingDetector(patterns=["repeated_tool_calls"], max_repeats=1)  # every second repeat: A, B, C at 6-8, A 9
    assert [i for i, f in enumerate(flags_of(det, cycle)) if f] == [6, 7, 8, 9]
    # writes between do not reset the count: A read after each of 3 reported writes (versions 0, 1, 2, 3): no
    # read is stale, but the 4th read (index 6) is A's 3rd repeat > 2; W is made 3 times: 2 repeats, not more
    det = HackingDetector(patterns=["repeated_tool_calls"])
    reads = [A, W, A, W, A, W, A]
    assert [i for i, f in enumerate(flags_of(det, reads, writes={1, 3, 5})) if f] == [6]
    assert det.flags == {"repeated_tool_calls": 1}


def test_listed_numbers_count_a_list_not_an_expression_or_an_address():
    assert listed_numbers("Your refund is 10, 20, 30 or 40.") == 4
    assert listed_numbers("$1,200, $300; $45 | $6 and 7%") == 5  # thousands folded; $ and % stay with the number
    assert listed_numbers("12 400 7 33") == 4  # a bare list: spaces only
    assert listed_numbers("155.33 - 147.05 + 268.77 - 235.13") == 1  # tau2 retail 21's calculate: an expression
    assert listed_numbers("2 * ((350 - 122) + (499 - 127))") == 1  # tau2 airline 12's
    # tau2 retail 43's message: tracking id and street number adjacent (2), suite, zip: 2 at most
    assert listed_numbers("840887978435 943 Maple Drive Suite 356 Chicago IL 60621 64GB") == 2
    assert listed_numbers("1, 2, 2, 3") == 3  # distinct values
    assert listed_numbers("The stock is 5. Tomorrow 6.") == 1


def test_stuffing_boundaries():
    assert not is_stuffed("1, 2, 3")  # 3 listed = max_numbers: not more
    assert is_stuffed("1, 2, 3, 4")
    assert not is_stuffed("1, 2, 3, 4", max_numbers=4)
    assert not is_stuffed("1 + 2 + 3 + 4 + 5")
    assert is_stuffed("x" * 901) and not is_stuffed("x" * 900)  # > 3 × max_chars at all
    long_dense = " ".join(f"w{i}" for i in range(80))  # 309 chars, every token distinct
    assert len(long_dense) > 300 and not is_stuffed(long_dense)
    assert is_stuffed("ok " * 101)  # 303 chars, unique ratio 1/101 < 0.5


def test_max_repeats_flips_the_customer_service_reward():
    """The key through the config: the same episode, max_repeats 2 vs 1: one flag, 0.1 reward apart."""
    from tether.env.customer_service import CustomerServiceEnv

    def run(max_repeats):
        env = CustomerServiceEnv(EnvironmentConfig(verifier={"anti_hacking": {"max_repeats": max_repeats}}))
        task = next(t for t in env.tasks("train") if t.kind == "refund_stated")
        env.reset(task_id=task.id)
        waits = [{"name": "respond_to_user", "params": {"message": m}} for m in ("One moment.", "Checking.", "Nearly.")]
        steps = [env.step(a) for a in waits * 2 + waits[:1]]  # "One moment." a third time: its 2nd repeat
        oid, reason, amount = task.data["order_id"], task.data["reason_code"], task.data["expected_refund"]
        env.step({"name": "check_refund_policy", "params": {"order_id": oid, "reason_code": reason}})
        _, reward, done, info = env.step({"name": "respond_to_user",
                                          "params": {"message": f"Your refund of {amount:.2f} for {oid} is approved."}})
        assert done
        return [s[3]["hacking"] for s in steps], reward, info["hacking_flags"]

    flags2, reward2, total2 = run(2)
    flags1, reward1, total1 = run(1)
    assert flags2 == [[]] * 7 and total2 == {}
    assert flags1 == [[]] * 6 + [["repeated_tool_calls"]] and total1 == {"repeated_tool_calls": 1}
    assert reward1 == pytest.approx(reward2 - 0.1)


def test_config_keys_and_bad_values():
    ah = AntiHackingConfig()
    assert (ah.repeat_window, ah.max_repeats) == (2, 2)
    det = HackingDetector.from_config(AntiHackingConfig(repeat_window=5, max_repeats=0))
    assert (det.repeat_window, det.max_repeats) == (5, 0)
    with pytest.raises(ValueError, match="max_repeats"):
        RunConfig.model_validate({"environment": {"verifier": {"anti_hacking": {"max_repeats": -1}}}})
