"""tether.heap: a run's objects frozen out of the collector's full passes while it is open, handed back at close."""

from __future__ import annotations

import gc
import weakref

import pytest

from tether import heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def unfrozen():
    if gc.get_freeze_count():
        pytest.skip("something in this process froze the heap already")
    yield
    assert gc.get_freeze_count() == 0, "a test left the heap frozen"


def test_a_frozen_cycle_is_kept_until_the_freeze_is_undone():
    node = Node()
    ref = weakref.ref(node)
    undo = heap.freeze()
    assert gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert ref() is not None  # frozen: the full collection skipped it
    undo()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # back in the oldest generation: collected


def test_objects_made_after_the_freeze_are_collected_as_before():
    undo = heap.freeze()
    try:
        node = Node()
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None
    finally:
        undo()


def test_collect_first_frees_the_garbage_alive_at_the_freeze():
    node = Node()
    ref = weakref.ref(node)
    del node  # garbage, not yet collected
    undo = heap.freeze(collect=True)
    try:
        assert ref() is None
    finally:
        undo()


def test_freezes_nest_and_each_undo_counts_once():
    first, second = heap.freeze(), heap.freeze()
    first()
    first()  # idempotent: does not undo the second freeze
    assert gc.get_freeze_count() > 0
    second()
    assert gc.get_freeze_count() == 0


def test_a_run_freezes_what_it_built_until_it_closes(tiny_model, tmp_path):
    from conftest import SMALL_RUN
    from tether.config import load_config
    from tether.pipeline.build import Run

    (tmp_path / "cfg.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "cfg.yaml"], [f"model.path={tiny_model}"])
    with Run.build(cfg, tmp_path / "run", show_progress=False) as run:
        assert gc.get_freeze_count() > 0
        engine = weakref.ref(run.rt.engine)
    assert gc.get_freeze_count() == 0
    del run
    gc.collect()
    assert engine() is None  # nothing of the closed run is kept by the freeze
