"""``StreamedUpdates``: a step of several optimizer updates fed as its data arrives makes ``Learner.train_step``'s
updates — the mini-batches cut at ``mini_batch_size`` in order (the last the remainder), π_prox of the later ones
the step's starting weights, the max-KL guard stopping the step alike.

The demo's learner config on the tiny model, two steps of 8 groups × 8 trajectories (one group dropped in the
second: 56 trajectories, so the last update holds the remainder), fed in chunks that straddle the mini-batch cuts.
Tolerance: the gradient summed in another order (float32), as ``test_learner_group``'s.
"""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import make_learner
from test_learner_group import DEMO, advantages, batch, behave
from tether.config import load_config
from tether.learner import load_model_and_tokenizer
from tether.learner.updates import StreamedUpdates

CHUNKS = [5, 11, 3, 13, 8, 1, 15, 8]  # trajectories per add_trajectories call (64 in all; cuts straddled)


def _learner(tiny, *overrides):
    cfg = load_config([DEMO], ["model.preset=null", f"model.path={tiny}", *overrides])
    model, _ = load_model_and_tokenizer(tiny)
    torch.manual_seed(0)
    return make_learner(model, cfg)


def _steps(tiny, streamed, *overrides, parts=False):
    """Two steps of ``overrides``' learner, streamed in ``CHUNKS`` (or a group a part, two threads at a time:
    ``parts``) or by ``train_step``: metrics and weights."""
    learner = _learner(tiny, *overrides)
    out = []
    for step in (1, 2):
        groups = batch(step, learner.model.config.vocab_size)
        behave(learner.model, groups, step)
        groups = groups if step == 1 else groups[:-1]  # step 2: a group dropped, 56 trajectories
        trajs = [t for g in groups for t in g]
        adv = torch.cat([advantages(g) for g in groups])
        if not streamed:
            out.append(learner.train_step(trajs, adv))
            continue
        update = learner.begin_step()
        if parts:
            update.add_parts([(g, advantages(g)) for g in groups], 2, 1)
            out.append(learner.finish_step(update))
            continue
        assert isinstance(update, StreamedUpdates)
        i = 0
        for n in CHUNKS:
            update.add_trajectories(trajs[i:i + n], adv[i:i + n])
            i += n
        assert i >= len(trajs)
        out.append(learner.finish_step(update))
    weights = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    return out, weights, learner


def _same(a, b):
    (ma, wa, _), (mb, wb, _) = a, b
    for x, y in zip(ma, mb):
        for key in ("optim/loss", "optim/grad_norm", "optim/entropy", "optim/is_ratio_mean", "optim/kl_divergence",
                    "optim/trained_tokens", "optim/kl_guard_stops"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


@pytest.mark.parametrize("correction, proximal", [("double_sided_importance_sampling", "step_start"),
                                                  ("double_sided_importance_sampling", "update_start"),
                                                  ("none", "step_start")])
def test_streamed_updates_are_train_steps(tiny_model, correction, proximal):
    """4 updates a step (mini 16 of 64), with the demo's off-policy correction (π_prox of updates 2-4 scored under
    the kept starting weights, or each update's own first forward: update_start) and without one (π_prox =
    π_behav: nothing kept)."""
    sets = ["learner.mini_batch_size=16", "learner.gradient_accumulation_steps=2",
            f"learner.off_policy_correction.method={correction}",
            f"learner.off_policy_correction.proximal={proximal}"]
    streamed, stepped = _steps(tiny_model, True, *sets), _steps(tiny_model, False, *sets)
    _same(streamed, stepped)
    assert streamed[2].streams
    # the weights moved 4 times a step: not the one-update step's weights
    _, one, _ = _steps(tiny_model, False, "learner.mini_batch_size=64", "learner.gradient_accumulation_steps=2",
                       f"learner.off_policy_correction.method={correction}")
    assert max(float((one[k] - streamed[1][k]).abs().max()) for k in one) > 1e-4


@pytest.mark.parametrize("sets", [
    ("learner.mini_batch_size=16", "learner.gradient_accumulation_steps=2"),  # the demo's: 2 groups an update
    ("learner.mini_batch_size=16", "learner.gradient_accumulation_steps=2",  # updates 2-4 score π_prox: one by one
     "learner.off_policy_correction.proximal=step_start"),
    ("learner.mini_batch_size=64", "learner.gradient_accumulation_steps=8")])  # one update: 8 groups on 2 threads
def test_groups_added_by_two_threads_at_once_make_train_steps_updates(tiny_model, monkeypatch, sets):
    """``add_parts``: the groups that fit the open update are forwarded and back-propagated two at a time, each on
    its own thread; the updates are ``train_step``'s (the gradient summed in another order)."""
    from tether.learner.accumulate import Accumulation

    threads, real = set(), Accumulation.add

    def add(self, batch):
        threads.add(threading.current_thread().name.split("_")[0])
        return real(self, batch)

    monkeypatch.setattr(Accumulation, "add", add)
    added = _steps(tiny_model, True, *sets, parts=True)
    _same(added, _steps(tiny_model, False, *sets))
    assert "tether-learner" in threads  # the parts were added from the pool's threads
    assert added[2].concurrent_adds
    # model.lora: the KL reference is the policy with its adapter switched off, for every thread: one at a time
    from tether.learner import lora

    cfg = load_config([DEMO], ["model.preset=null", f"model.path={tiny_model}", "model.lora.rank=8"])
    assert not make_learner(lora.wrap(load_model_and_tokenizer(tiny_model)[0], cfg.model.lora), cfg).concurrent_adds


def test_the_max_kl_guard_stops_a_streamed_step_as_it_stops_train_step(tiny_model):
    # the first update's KL is over max_kl: 1 update a step
    sets = ["learner.mini_batch_size=16", "learner.gradient_accumulation_steps=2",
            "policy_optimization.kl_control.max_kl=1e-9", "policy_optimization.kl_control.target_kl=1e-10"]
    streamed, stepped = _steps(tiny_model, True, *sets), _steps(tiny_model, False, *sets)
    _same(streamed, stepped)
    assert [m["optim/kl_guard_stops"] for m in streamed[0]] == [1.0, 2.0]
    unguarded = _steps(tiny_model, False, "learner.mini_batch_size=16", "learner.gradient_accumulation_steps=2")
    assert max(float((unguarded[1][k] - streamed[1][k]).abs().max()) for k in unguarded[1]) > 1e-4


def test_which_learners_stream(tiny_model):
    assert _learner(tiny_model, "learner.mini_batch_size=64").streams  # one update
    demo = _learner(tiny_model)
    assert demo.streams and demo.updates_per_pass == 4 and demo.prox_per_update  # the demo's: π_prox own forwards
    assert _learner(tiny_model, "learner.off_policy_correction.proximal=step_start").streams  # the copy kept
    assert not _learner(tiny_model, "learner.mini_batch_size=32", "learner.update_frequency=2").streams
    # DetachActorWorker scores π_prox under the last sync's weights, which a step's updates do not hold
    detach = ("actor_worker.class=DetachActorWorker", "learner.off_policy_correction.proximal=step_start")
    assert not _learner(tiny_model, *detach).streams
    assert _learner(tiny_model, detach[0]).streams  # update_start: the held weights are not π_prox (warned at load)
    cfg = load_config([DEMO], ["model.preset=null", f"model.path={tiny_model}", detach[0], "rollout.mode=fully_async",
                               "trainer.trigger_parameter_sync_step=2"])
    assert any("DetachActorWorker changes nothing" in w and "proximal: update_start" in w for w in cfg.warnings())


def test_train_step_cuts_mini_batches_at_mini_batch_size(tiny_model):
    """56 trajectories, mini 16: updates of 16, 16, 16 and 8 (as verl cuts them), not four near-equal ones of 14."""
    learner = _learner(tiny_model, "learner.mini_batch_size=16", "learner.gradient_accumulation_steps=2")
    groups = batch(2, learner.model.config.vocab_size)[:-1]
    behave(learner.model, groups, 2)
    sizes = []
    real = learner._update

    def update(mini, *a, **kw):
        sizes.append(mini.num_trajectories)
        return real(mini, *a, **kw)

    learner._update = update
    learner.train_step([t for g in groups for t in g], torch.cat([advantages(g) for g in groups]))
    assert sizes == [16, 16, 16, 8]



def _scored(learner):
    """Rows ``learner.score`` is asked for, per call (spied)."""
    calls, score = [], learner.score
    learner.score = lambda batch, device, skip=0: calls.append(len(batch) - skip) or score(batch, device, skip)
    return calls


def test_proximal_update_start_scores_nothing_and_changes_a_step_of_several_updates(tiny_model):
    """off_policy_correction.proximal flipped: step_start scores the 48 rows of updates 2-4 under the step's start
    (train_step before its first update; streamed, the groups after the first update under the kept copy);
    update_start scores nothing (each update's π_prox is its own first forward) and trains otherwise. With one update a
    step the two are the same update."""
    sets = ["learner.mini_batch_size=16", "learner.gradient_accumulation_steps=2",
            "learner.off_policy_correction.proximal=step_start"]
    counts = {}
    for proximal in ("step_start", "update_start"):
        for streamed in (False, True):
            learner = _learner(tiny_model, *sets[:2], f"learner.off_policy_correction.proximal={proximal}")
            calls = _scored(learner)
            groups = batch(1, learner.model.config.vocab_size)
            behave(learner.model, groups, 1)
            trajs, adv = [t for g in groups for t in g], torch.cat([advantages(g) for g in groups])
            if streamed:
                update = learner.begin_step()
                for g, a in zip(groups, adv.split(8)):
                    update.add_trajectories(g, a)
                learner.finish_step(update)
            else:
                learner.train_step(trajs, adv)
            counts[proximal, streamed] = sum(calls)
    assert counts == {("step_start", False): 48, ("step_start", True): 48,
                      ("update_start", False): 0, ("update_start", True): 0}
    # at the demo's lr the policy moves ~1e-4 in a step, so the ratios differ in the 4th digit; at 1e-2 they clip
    fast = [*sets, "policy_optimization.optimizer.lr=1e-2"]
    start = _steps(tiny_model, False, *fast)
    update = _steps(tiny_model, False, *fast, "learner.off_policy_correction.proximal=update_start")
    assert max(float((start[1][k] - update[1][k]).abs().max()) for k in start[1]) > 1e-4
    assert start[0][0]["optim/clip_ratio_high"] + start[0][0]["optim/clip_ratio_low"] > 0  # step_start's clip acts
    assert update[0][0]["optim/clip_ratio_high"] + update[0][0]["optim/clip_ratio_low"] == 0  # ratio 1: never
    one = [_steps(tiny_model, False, "learner.mini_batch_size=64", f"learner.off_policy_correction.proximal={p}")
           for p in ("step_start", "update_start")]
    assert all(torch.equal(one[0][1][k], one[1][1][k]) for k in one[0][1])


def test_a_part_that_fails_on_another_thread_raises_in_the_caller(tiny_model):
    learner = _learner(tiny_model, "learner.mini_batch_size=64", "learner.gradient_accumulation_steps=8")
    groups = batch(1, learner.model.config.vocab_size)
    behave(learner.model, groups, 1)
    update = learner.begin_step()
    parts = [(g, advantages(g)) for g in groups[:3]] + [(groups[3], advantages(groups[3])[:-1])]  # one short
    with pytest.raises(ValueError, match="advantages"):
        update.add_parts(parts, 2, 1)


def test_parts_added_at_once_count_their_wall_time_once(tiny_model):
    """``busy_s`` (what ``perf/tokens_per_s`` divides by) is the wall time of ``add_parts``, not its threads' sum."""
    import time

    learner = _learner(tiny_model, "learner.mini_batch_size=64", "learner.gradient_accumulation_steps=8")
    groups = batch(1, learner.model.config.vocab_size)
    behave(learner.model, groups, 1)
    update = learner.begin_step()
    t0 = time.perf_counter()
    update.add_parts([(g, advantages(g)) for g in groups], 2, 1)
    wall = time.perf_counter() - t0
    assert 0 < update.busy_s <= wall and update.trajectories == 64
