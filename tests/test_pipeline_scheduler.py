import pytest

from tether.pipeline.scheduler import StartOrder, plan_batch, select, window_for


def test_select_by_hand():
    # finished (in finish order) 4, 2, 9, 5; oldest unconsumed 2, window 4 → window [2, 6)
    assert select([4, 2, 9, 5], 2, 4, 10) == [4, 2, 5]  # 9 is outside; finish order kept
    assert select([4, 2, 9, 5], 2, 4, 2) == [4, 2]
    assert select([4, 2, 9, 5], 2, None, 3) == [4, 2, 9]  # fifo: finish order, no window
    assert select([7, 8], 3, 4, 5) == []  # window [3, 7): nothing finished in it
    assert select([], 0, 4, 5) == []


def test_start_order_low_water_mark():
    order = StartOrder()
    for s in (1, 3, 4):
        order.retire(s)
    assert order.oldest_unconsumed == 0
    assert order.oldest_after([0]) == 2 and order.oldest_unconsumed == 0  # a what-if changes nothing
    order.retire(0)
    assert order.oldest_unconsumed == 2
    order.retire(2)
    assert order.oldest_unconsumed == 5
    assert order.is_retired(3) and not order.is_retired(5)
    with pytest.raises(ValueError, match="twice"):
        order.retire(4)


def consume(finish_order, window, n):
    """Batches of n from groups arriving in ``finish_order``, taking a batch as soon as it can be planned."""
    order, pending, batches = StartOrder(), [], []
    for s in finish_order:
        pending.append(s)
        while (b := plan_batch(pending, order, window, n)) and len(b) == n:
            batches.append(b)
            for x in b:
                pending.remove(x)
                order.retire(x)
    return batches, pending


def test_groups_0_to_9_with_3_late():
    finish = [0, 1, 2, 4, 5, 6, 7, 8, 9, 3]  # 3 is slow and finishes last
    # fifo: finish order, 3 is overtaken by everything
    assert consume(finish, None, 2) == ([[0, 1], [2, 4], [5, 6], [7, 8], [9, 3]], [])
    # window 4: after [0,1],[2,4] the oldest unconsumed is 3 → window [3, 7) holds 5, 6 but not 7, 8, 9;
    # when 3 arrives it is taken, retiring it slides the window to [7, 11) within the same batch → [3, 7]
    assert consume(finish, 4, 2) == ([[0, 1], [2, 4], [5, 6], [3, 7], [8, 9]], [])
    # window 1 = strict start order
    assert consume(finish, 1, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]], [])
    # window 2: [3, 5) → 4 goes before 3, 5 must wait
    assert consume(finish, 2, 2) == ([[0, 1], [2, 4], [3, 5], [6, 7], [8, 9]], [])


def test_plan_batch_slides_the_window_inside_a_batch():
    order = StartOrder()
    # window 2, finished 0, 1, 2, 3: the fixed window [0, 2) gives 2, sliding gives all 4
    assert select([0, 1, 2, 3], 0, 2, 4) == [0, 1]
    assert plan_batch([0, 1, 2, 3], order, 2, 4) == [0, 1, 2, 3]
    # finished 4, 1, 0 (in that order): window [0, 2) → 1, 0; then the window is [2, 4) and 4 is outside it
    assert plan_batch([4, 1, 0], order, 2, 4) == [1, 0]
    assert plan_batch([3, 1, 0], order, 2, 4) == [1, 0, 3]  # 3 is inside [2, 4): it may overtake 2
    assert order.oldest_unconsumed == 0  # planning does not retire


def test_overdue_groups_may_pass_the_window_in_finish_order():
    # finished (in finish order) 9, 4, 8, 7; oldest unconsumed 2, window 4 → window [2, 6) holds only 4
    assert select([9, 4, 8, 7], 2, 4, 10) == [4]
    # 8 and 9 have been held max_hold_s: they pass, in finish order; 7 (not overdue) still waits
    assert select([9, 4, 8, 7], 2, 4, 10, overdue={8, 9}) == [9, 4, 8]
    assert select([9, 4, 8, 7], 2, 4, 2, overdue={8, 9}) == [9, 4]
    # inside a batch: taking 2 (overdue or not) slides the window to [3, 7), which lets 6 in
    order = StartOrder()
    order.retire(0)
    order.retire(1)
    assert plan_batch([9, 2, 6], order, 4, 3) == [2, 6]  # window [2, 6) then [3, 7)
    assert plan_batch([9, 2, 6], order, 4, 3, overdue={9}) == [9, 2, 6]
    assert order.oldest_unconsumed == 2  # planning does not retire


def test_window_for_config():
    assert window_for("fifo", 64) is None
    assert window_for("windowed_fifo", 64) == 64
    with pytest.raises(ValueError, match="window_size"):
        window_for("windowed_fifo", 0)
