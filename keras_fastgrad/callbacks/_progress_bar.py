"""Keeps log keys that hold nothing to read yet off `fit`'s progress bar,
while every callback, `History` included, still gets every key.

Keras' `CallbackList` hands one logs dict to its callbacks in order, and
appends `History` and the `ProgbarLogger` after the user's: a key removed
from that dict would be lost to `History` and to a `CSVLogger` or
`TensorBoard` listed later. So only the progress bar is given a copy
without the hidden keys: its `on_train_batch_end` and `on_epoch_end` are
wrapped on the instance, for one `fit`.
"""

import functools

import keras

from keras_fastgrad import _compat as compat

_HOOKS = ("on_train_batch_end", "on_epoch_end")


def hide_keys(hidden_keys):
    """Hides the keys `hidden_keys(logs)` returns (a function of each call's
    logs) from the progress bar of the `fit` whose `CallbackList` is calling
    the caller's `set_model`.

    Returns a function that shows them again, or `None` when no `fit`'s
    callbacks are being set up or `fit` shows no progress bar
    (`verbose=0`)."""
    callbacks = compat.calling_callback_list()
    bars = [
        c
        for c in getattr(callbacks, "callbacks", ())
        if isinstance(c, keras.callbacks.ProgbarLogger)
    ]
    if not bars:
        return None
    bar = bars[0]
    quiet = vars(bar).get("_fg_quiet")
    if quiet is None:
        quiet = bar._fg_quiet = _QuietBar(bar)
    quiet.hiders.append(hidden_keys)
    return functools.partial(quiet.show_again, hidden_keys)


class _QuietBar:
    """The wrapped hooks of one `ProgbarLogger`, and who hides what."""

    def __init__(self, bar):
        self.bar = bar
        self.hiders = []
        self.own_hooks = {name: vars(bar).get(name) for name in _HOOKS}
        for name in _HOOKS:
            setattr(bar, name, self._showing_less(getattr(bar, name)))

    def _showing_less(self, hook):
        @functools.wraps(hook)
        def showing_less(step, logs=None):
            return hook(step, self.shown(logs))

        return showing_less

    def shown(self, logs):
        """`logs` without the keys any hider hides now."""
        if not logs:
            return logs
        hidden = {key for hider in self.hiders for key in hider(logs)}
        return {k: v for k, v in logs.items() if k not in hidden}

    def show_again(self, hidden_keys):
        if hidden_keys in self.hiders:
            self.hiders.remove(hidden_keys)
        if self.hiders or vars(self.bar).get("_fg_quiet") is not self:
            return
        for name, hook in self.own_hooks.items():
            if hook is None:
                vars(self.bar).pop(name, None)
            else:
                setattr(self.bar, name, hook)
        del self.bar._fg_quiet
