"""The train–inference mismatch (``rollout/logp_abs_diff_mean``, ``rollout/mismatch_kl``): measured on the tokens the
engine sampled with the weights the trainer scores them under, in a real run; a weight sync that silently never
reaches the engine (TRL #5312's failure) makes it jump and trips the ``shift/mismatch`` monitor."""

from __future__ import annotations

from tether.engine.local import LocalEngine

RUN = ("trainer.total_steps=3", "trainer.save_every=0", "policy_optimization.optimizer.lr=1e-2",
       "monitors.patience=1")


def test_a_sync_run_measures_the_mismatch_on_every_step(small_run):
    rows, _, _ = small_run("sync", *RUN)
    steps = [r for r in rows if "optim/loss" in r]
    gaps = [r["rollout/logp_abs_diff_mean"] for r in steps]
    kls = [r["rollout/mismatch_kl"] for r in steps]
    print(f"fp32 sync: mean |Δ log π| per step {[f'{g:.2e}' for g in gaps]}, mismatch KL {[f'{k:.2e}' for k in kls]}")
    assert len(gaps) == 3 and all(0 <= g < 1e-4 for g in gaps)  # one engine, one trainer, fp32: arithmetic only
    assert all(abs(k) < 1e-6 for k in kls)
    assert all(r["monitor/shift/mismatch"] == 0 for r in steps)


def test_bf16_beside_fp32_the_mismatch_is_rounding_sized(small_run):
    """The same run in fp32 and in bf16 (fp32 master weights, bf16 autocast trainer, bf16 engine copy): fp32 measures
    arithmetic only, bf16 the two bf16 forwards' rounding, the field's healthy 0.01–0.02 band or below (TRL #5312)."""
    figures = {}
    for dtype in ("float32", "bfloat16"):
        rows, _, _ = small_run(dtype, *RUN, f"model.dtype={dtype}")
        steps = [r for r in rows if "optim/loss" in r]
        figures[dtype] = ([r["rollout/logp_abs_diff_mean"] for r in steps], [r["rollout/mismatch_kl"] for r in steps])
        print(f"{dtype}: mean |Δ log π| per step {[f'{g:.2e}' for g in figures[dtype][0]]}, "
              f"mismatch KL {[f'{k:.2e}' for k in figures[dtype][1]]}")
    fp32, bf16 = figures["float32"], figures["bfloat16"]
    assert len(bf16[0]) == 3 and max(fp32[0]) < 1e-4
    assert all(1e-4 < g < 0.02 for g in bf16[0])  # rounding is visible, and healthy
    assert min(bf16[0]) > 100 * max(fp32[0])
    assert all(abs(k) < 1e-3 for k in bf16[1])


def test_a_sync_that_never_reaches_the_engine_trips_the_monitor(small_run, monkeypatch):
    real = LocalEngine.update_weights

    def lost(self, state_dict, version):  # the version moves on, the weights do not: a silently failed sync
        real(self, {}, version)

    monkeypatch.setattr(LocalEngine, "update_weights", lost)
    rows, _, _ = small_run("lost", *RUN, "monitors.max_logp_abs_diff=0.03")  # healthy: 1e-7 here, ~0.01–0.02 in bf16
    steps = [r for r in rows if "optim/loss" in r]
    gaps = [r["rollout/logp_abs_diff_mean"] for r in steps]
    kls = [r["rollout/mismatch_kl"] for r in steps]
    print(f"sync lost: mean |Δ log π| per step {[f'{g:.2e}' for g in gaps]}, mismatch KL {[f'{k:.2e}' for k in kls]}")
    assert gaps[0] < 1e-4  # step 1: the weights both started from
    # measured 0.068, 0.099: the engine still samples with the initial weights, the trainer has moved on
    assert min(gaps[1:]) > 0.05
    assert steps[0]["monitor/shift/mismatch"] == 0 and steps[1]["monitor/shift/mismatch"] == 1
