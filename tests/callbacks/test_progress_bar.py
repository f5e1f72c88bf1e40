"""What `fit(verbose=1)` prints with a `NonFiniteGuard`, read as a user reads
it: a healthy fit shows no `nonfinite_*` key on its progress bar, a fit that
met a NaN shows them from then on; `History` and `CSVLogger` get every key
every epoch either way. Backend-neutral: collected under both backends, the
same tests on TensorFlow and JAX."""

import csv
import re

import keras
import numpy as np
import pytest

import keras_fastgrad
from keras_fastgrad.callbacks import NonFiniteGuard

KEYS = ("nonfinite_count", "nonfinite_first_index", "nonfinite_num_variables")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(autouse=True)
def fresh_session():
    keras.backend.clear_session(free_memory=False)
    yield
    keras.backend.clear_session(free_memory=False)


def mlp(cls=keras_fastgrad.FastGradModel):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    model = cls(inputs, keras.layers.Dense(1, name="out")(hidden))
    model.compile(optimizer="sgd", loss="mse")
    return model


def data(nan_row=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    if nan_row is not None:
        x[nan_row, 0] = np.nan
    return x, rng.normal(size=(16, 1)).astype("float32")


def progress_lines(out):
    """The progress bar's updates, as a user reads them one after the other:
    without the colour codes, one per update (Keras redraws its line with
    backspaces and carriage returns, or prints the next update after it)."""
    text = re.sub(r"[\b\r]+", "\n", ANSI.sub("", out))
    updates = re.split(r"(?=\b\d+/\d+ [━ ])|\n", text)
    return [line.strip() for line in updates if "step" in line]


def fit(model, x, y, capsys, callbacks, epochs=2):
    capsys.readouterr()
    history = model.fit(
        x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=1, callbacks=callbacks
    )
    return history, progress_lines(capsys.readouterr().out)


def csv_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


class EpochLogs(keras.callbacks.Callback):
    """The keys of the logs a callback gets, as `keras.callbacks.TensorBoard`
    reads them (its epoch scalars; its batch scalars with `update_freq`)."""

    def __init__(self):
        super().__init__()
        self.epochs, self.batches = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(set(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(set(logs))


@pytest.mark.parametrize(
    "cls", [keras_fastgrad.FastGradModel, keras.Model], ids=["fastgrad", "plain"]
)
def test_a_healthy_fit_shows_no_nonfinite_key_on_the_progress_bar(cls, capsys, tmp_path):
    model = mlp(cls)
    x, y = data()
    before, after = str(tmp_path / "before.csv"), str(tmp_path / "after.csv")
    seen_before, seen_after = EpochLogs(), EpochLogs()
    history, lines = fit(
        model,
        x,
        y,
        capsys,
        [
            keras.callbacks.CSVLogger(before),
            seen_before,
            NonFiniteGuard("warn"),
            keras.callbacks.CSVLogger(after),
            seen_after,
        ],
    )
    assert lines and all(" - loss: " in line for line in lines), lines
    assert not [line for line in lines if "nonfinite" in line], lines
    # ... yet every key reaches History and CSVLogger, every epoch, wherever listed.
    assert {key: history.history[key] for key in KEYS} == {
        "nonfinite_count": [0.0, 0.0],
        "nonfinite_first_index": [-1.0, -1.0],
        "nonfinite_num_variables": [0.0, 0.0],
    }
    for path in (before, after):
        rows = csv_rows(path)
        assert len(rows) == 2
        assert set(KEYS) <= set(rows[0]), rows[0]
        assert [float(row["nonfinite_count"]) for row in rows] == [0.0, 0.0]
    for seen in (seen_before, seen_after):
        assert len(seen.epochs) == 2 and len(seen.batches) == 8
        assert all(set(KEYS) <= keys for keys in seen.epochs + seen.batches)


def test_after_a_nan_batch_the_progress_bar_shows_the_keys(capsys, tmp_path):
    model = mlp()
    x, y = data(nan_row=5)  # batch 1 of 4 in each epoch
    path = str(tmp_path / "log.csv")
    with pytest.warns(RuntimeWarning, match="non-finite micro-batch") as caught:
        history, lines = fit(
            model, x, y, capsys, [NonFiniteGuard("warn"), keras.callbacks.CSVLogger(path)]
        )
    # The guard's own report, as before.
    reports = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert [report.split(". The latest")[0] for report in reports] == [
        f"Epoch {e}: 1 non-finite micro-batch(es) dropped in this epoch" for e in (0, 1)
    ]
    # The first update comes before the NaN: quiet.
    assert lines[0].startswith("1/4") and "nonfinite" not in lines[0], lines
    # Each epoch's last line says what happened; the second epoch's lines
    # all do (the fit has met a NaN).
    finals = [line for line in lines if line.startswith("4/4")]
    assert len(finals) == 2, lines
    assert "nonfinite_count: 1.0000" in finals[0], finals
    # (Keras 3.15's bar shows the latest value, 2; Keras 3.8's averages the
    # epoch's batches, 1.8: either way above the first epoch's 1.)
    shown = re.search(r"nonfinite_count: (\d+\.\d+)", finals[1])
    assert shown and 1.0 < float(shown.group(1)) <= 2.0, finals
    assert all("nonfinite_first_index:" in line for line in finals)
    second = lines[lines.index(finals[0]) + 1 :]
    assert second and all("nonfinite_count:" in line for line in second), lines
    assert history.history["nonfinite_count"] == [1.0, 2.0]
    rows = csv_rows(path)
    assert [float(row["nonfinite_count"]) for row in rows] == [1.0, 2.0]


def test_a_nan_in_an_earlier_fit_leaves_a_healthy_fit_quiet(capsys):
    model = mlp()
    x, y = data(nan_row=5)
    with pytest.warns(RuntimeWarning):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[NonFiniteGuard("warn")])
    x, y = data()
    history, lines = fit(model, x, y, capsys, [NonFiniteGuard("warn")], epochs=1)
    assert lines and not [line for line in lines if "nonfinite" in line], lines
    assert history.history["nonfinite_count"] == [1.0]  # the model's count, unchanged


def test_a_progress_bar_of_the_user_is_quiet_too_and_left_as_it_was(capsys):
    model = mlp()
    x, y = data()
    bar = keras.callbacks.ProgbarLogger()
    _, lines = fit(model, x, y, capsys, [bar, NonFiniteGuard("warn")], epochs=1)
    assert lines and not [line for line in lines if "nonfinite" in line], lines
    assert not {"on_train_batch_end", "on_epoch_end"} & set(vars(bar))
    # Without the guard, the same bar shows what the logs hold.
    model.enable_telemetry(["nonfinite_count"])
    _, lines = fit(model, x, y, capsys, [bar], epochs=1)
    assert "nonfinite_count: 0.0000e+00" in lines[-1], lines
