"""How `micro_batches` splits a batch: as `numpy.array_split`, no padding.

A batch of n rows split m ways gives `k = max(min(m, n), 1)` slices (one,
empty, for an empty batch), the first `n mod k` of `ceil(n / k)` rows and
the others of `floor(n / k)` (`slice_sizes`). Slice `i` takes the rows
`start(i)` to `start(i) + rows(i) - 1`: every row is in exactly one slice,
in order, and no slice holds anything else (`SlicePlan`). The slices of one
size form a group (`SlicePlan.groups`): a loop with a static slice shape
runs once per group.

Written once for both backends, importing neither: the plan's numbers are
Python ints (a static batch) or scalar tensors (a traced one); the
comparisons a tensor needs are passed in (`minimum`, `maximum`,
`indicator`), Python's own by default.
"""

import typing

from keras import tree


def first_input(x):
    """The first input tensor of `x`: the step reads the batch size from it.

    Raises:
        ValueError: when `x` holds no tensor (`fit([None], y)`): without
            this, the lookup's `StopIteration` would end the epoch silently
            after zero steps. `keras.Model` raises `ValueError` here too.

    Example:

    >>> first_input([None, np.ones((3, 2))]).shape
    (3, 2)
    """
    for t in tree.flatten(x):
        if t is not None:
            return t
    raise ValueError(
        "`x` must hold at least one input tensor: the train step reads the "
        "batch size from the first input that is not None. Received: "
        f"x={x!r} (no tensor). Fix: pass the input data, e.g. "
        "`model.fit(x_train, y_train)` with `x_train` an array, or a "
        "list/dict of arrays with one per model input."
    )


class SliceGroup(typing.NamedTuple):
    """Slices `first` to `end - 1`, each of `size` rows (`end == first`:
    an empty group)."""

    first: typing.Any
    end: typing.Any
    size: typing.Any


class SlicePlan(typing.NamedTuple):
    """How a batch of `n` rows is split: `count` slices, the first `big`
    of `small + 1` rows, the others of `small` (`plan`).

    Fields are Python ints for a static batch, int32 scalars for a traced
    one. A method taking `minimum` / `indicator` uses Python's own unless
    the backend's are passed (a traced index).
    """

    n: typing.Any
    count: typing.Any
    small: typing.Any
    big: typing.Any

    def start(self, i, minimum=None):
        """The first row of slice `i` (`minimum`: the backend's, Python's
        `min` by default)."""
        return i * self.small + (minimum or min)(i, self.big)

    def rows(self, i, indicator=None):
        """The rows of slice `i`: `indicator(i < big)` is 1 or 0 (`int`, or
        a cast to the index's integer dtype for a traced `i`)."""
        return self.small + (indicator or int)(i < self.big)

    def groups(self):
        """`[SliceGroup]`: the `big` slices of `small + 1` rows, then the
        others of `small` (either group may be empty)."""
        return [
            SliceGroup(0, self.big, self.small + 1),
            SliceGroup(self.big, self.count, self.small),
        ]


def plan(n, slices, minimum=None, maximum=None):
    """The `SlicePlan` of a batch of `n` rows split `slices` ways.

    Args:
        n: Python int, or an int32 scalar with `minimum`/`maximum` the
            backend's.
        slices: Python int >= 1, the `micro_batches` option.

    Example:

    >>> plan(22, 3)
    SlicePlan(n=22, count=3, small=7, big=1)
    >>> [plan(22, 3).start(i) for i in range(3)], plan(22, 3).rows(2)
    ([0, 8, 15], 7)
    """
    count = (maximum or max)((minimum or min)(n, slices), 1)
    return SlicePlan(n, count, n // count, n % count)


def slice_sizes(n, slices):
    """The rows of each slice of a batch of `n` rows split `slices` ways:
    those of `numpy.array_split`, with no empty slice unless `n` is 0.

    Example:

    >>> slice_sizes(22, 3), slice_sizes(7, 4), slice_sizes(1, 2)
    ([8, 7, 7], [2, 2, 2, 1], [1])
    >>> [len(part) for part in np.array_split(np.arange(22), 3)]
    [8, 7, 7]
    """
    split = plan(n, slices)
    return [split.rows(i) for i in range(split.count)]


def static_groups(n, slices):
    """The non-empty `SliceGroup`s of a batch of a static `n` rows (Python
    ints): the loops a backend with static shapes runs, in order.

    Example:

    >>> static_groups(22, 3)
    [SliceGroup(first=0, end=1, size=8), SliceGroup(first=1, end=3, size=7)]
    >>> static_groups(0, 3)
    [SliceGroup(first=0, end=1, size=0)]
    """
    return [g for g in plan(n, slices).groups() if g.end > g.first]
