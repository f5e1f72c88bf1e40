"""tests/callbacks/test_progress_bar.py on Keras' JAX backend: what
`fit(verbose=1)` prints with a `NonFiniteGuard` (no `nonfinite_*` key while
the fit is healthy, every key once it met a NaN) and the keys `History`,
`CSVLogger` and the other callbacks get."""

from tests.callbacks.test_progress_bar import (  # noqa: F401 (collected here)
    fresh_session,
    test_a_healthy_fit_shows_no_nonfinite_key_on_the_progress_bar,
    test_a_nan_in_an_earlier_fit_leaves_a_healthy_fit_quiet,
    test_a_progress_bar_of_the_user_is_quiet_too_and_left_as_it_was,
    test_after_a_nan_batch_the_progress_bar_shows_the_keys,
)
