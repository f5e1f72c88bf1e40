"""Unit tests of the window's rules (`keras_fastgrad.step.accumulation`: no
backend imported), run under both backends on `keras.ops` values.

References: the window's gradient is compared with the gradient of the
concatenated batch's loss worked out in numpy (`sum_j S_j / sum_j D_j`
differentiated by hand for a linear loss), and the window's signals with
counts worked by hand. No expected value is taken from the rules' output.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_fastgrad.step import accumulation as rules

NAN = float("nan")


def values(window):
    """A `WindowState` as numpy, for comparison."""
    return rules.WindowState(
        [ops.convert_to_numpy(s) for s in window.sums],
        float(ops.convert_to_numpy(window.normaliser)),
        int(ops.convert_to_numpy(window.micro_step)),
        int(ops.convert_to_numpy(window.included)),
    )


def empty_window(shape=(3,)):
    return rules.WindowState(
        [ops.zeros(shape, "float32")],
        ops.zeros((), "float32"),
        ops.zeros((), "int32"),
        ops.zeros((), "int32"),
    )


def run_window(batches, steps):
    """Runs `(x, keep)` micro-batches through the rules as a shell does, the
    loss of a micro-batch of rows `x` being `sum(w . x_i) / rows` (`D_j` the
    rows, its gradient the mean row): returns the windows' gradients as
    applied (numpy), and the last window's state."""
    window, applied = empty_window(), []
    for x, keep in batches:
        d = float(len(x))
        grad = ops.convert_to_tensor(np.mean(x, axis=0).astype(np.float32))
        keep_value = keep if keep is True else ops.convert_to_tensor(keep)
        batch = rules.MicroBatch([grad * d], ops.convert_to_tensor(d), keep_value)
        window = rules.added(window, batch)
        complete = rules.is_complete(window.micro_step, steps)
        if bool(rules.applies(complete, window.included, every_kept=keep is True)):
            gradient = rules.window_gradient(window.sums, window.normaliser, True)
            applied.append(ops.convert_to_numpy(gradient[0]))
        if bool(complete):
            window = rules.emptied(window, ops.zeros_like)
    return applied, window


def test_window_gradient_is_the_concatenated_batchs():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(rows, 3)) for rows in (4, 1, 3)]
    applied, window = run_window([(x, True) for x in xs], steps=3)
    # the loss of the 8 rows together: sum(w . x_i) / 8, its gradient the mean row
    np.testing.assert_allclose(applied, [np.concatenate(xs).mean(axis=0)], rtol=1e-6)
    assert values(window)[1:] == (0.0, 3, 0)  # emptied, the micro-step runs on


def test_left_out_micro_batch_adds_nothing_but_its_micro_step():
    rng = np.random.default_rng(1)
    good = [rng.normal(size=(rows, 3)) for rows in (2, 5)]
    bad = np.full((7, 3), NAN)
    applied, _ = run_window([(good[0], True), (bad, False), (good[1], True)], steps=3)
    np.testing.assert_allclose(applied, [np.concatenate(good).mean(axis=0)], rtol=1e-6)


def test_window_of_only_left_out_micro_batches_is_not_applied():
    bad = np.full((2, 3), NAN)
    applied, window = run_window([(bad, False), (bad, False)], steps=2)
    assert applied == []
    assert values(window)[1:] == (0.0, 2, 0)


def test_windows_close_every_steps_micro_steps():
    x = np.ones((1, 3))
    applied, window = run_window([(x, True)] * 7, steps=3)
    assert len(applied) == 2  # micro-steps 3 and 6
    assert values(window)[1:] == (1.0, 7, 1)  # the third window holds one
    assert rules.pending(7, 3) == 1


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_is_last_before_the_count_is_is_complete_after_it(steps):
    for micro_step in range(3 * steps):
        before = bool(rules.is_last(ops.convert_to_tensor(micro_step), steps))
        after = bool(rules.is_complete(ops.convert_to_tensor(micro_step + 1), steps))
        assert before == after == ((micro_step + 1) % steps == 0)


def test_zero_normaliser_gives_a_zero_gradient_and_sum_is_not_divided():
    sums = [ops.convert_to_tensor(np.array([2.0, -4.0], np.float32)), None]
    zero = rules.window_gradient(sums, ops.convert_to_tensor(0.0), True)
    np.testing.assert_array_equal(ops.convert_to_numpy(zero[0]), [0.0, 0.0])
    assert zero[1] is None
    # `reduction="sum"`: the window's gradient is its sums
    assert rules.window_gradient(sums, None, False) is sums
    half = rules.window_gradient(sums, ops.convert_to_tensor(4.0), True)
    np.testing.assert_array_equal(ops.convert_to_numpy(half[0]), [0.5, -1.0])


def test_restart_starts_at_micro_step_zero_and_empties():
    window = rules.WindowState([np.ones(2)], 3.0, 5, 2)
    emptied = rules.emptied(window, np.zeros_like)
    restarted = rules.restarted(window, np.zeros_like)
    assert (float(emptied.normaliser), int(emptied.micro_step), int(emptied.included)) == (0, 5, 0)
    assert (float(restarted.normaliser), int(restarted.micro_step)) == (0, 0)
    np.testing.assert_array_equal(restarted.sums[0], [0.0, 0.0])


def test_an_old_files_window_counts_one_included_micro_batch_if_it_has_samples():
    assert rules.included_of_old_file(np.float32(12.0)) == 1
    assert rules.included_of_old_file(np.float32(0.0)) == 0


def test_accumulator_state_is_its_variables():
    acc = rules.WindowAccumulator(steps=2)
    acc.build([keras.Variable(np.zeros((2, 3), np.float32))])
    state = acc.state()
    assert list(state.sums) == acc.sums and state.included is acc.included
    assert acc.variables == [*state.sums, *state[1:]]  # the saved order
    assert not bool(acc.has_samples())
