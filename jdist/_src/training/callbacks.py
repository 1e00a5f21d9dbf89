"""The callback protocol: Keras' hook names, called by `Trainer`.

A callback sees the trainer as `self.model` (Keras' name), `self.params`
and, during `fit`, `self.fit_loop`. Per-batch `logs` are read from the
devices only when a callback looks at them (no synchronisation otherwise).
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable, Iterable

import jax

from jdist._src.keras import loading as keras_loading


def is_chief() -> bool:
  """Whether this process writes shared files (process 0)."""
  return jax.process_index() == 0


def resolve_mode(mode: str, monitor: str) -> str:
  """Keras' rule for a monitored value: "auto" is "max" for accuracies."""
  if mode not in ("auto", "min", "max"):
    raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}.")
  if mode == "auto":
    return "max" if "acc" in monitor else "min"
  return mode


class Callback:
  """Base class: override the hooks you need; all default to nothing.

  Example:
    >>> import jdist
    >>> class Count(jdist.Callback):
    ...   def on_train_batch_end(self, batch, logs=None):
    ...     self.seen = batch + 1
    >>> Count().on_train_batch_end(0)
  """

  def __init__(self):
    self.model = None
    self.params: dict = {}
    self.fit_loop = None

  @property
  def trainer(self):
    """The `jdist.Trainer` running this callback (also `self.model`)."""
    return self.model

  def set_model(self, model) -> None:
    self.model = model

  def set_params(self, params: dict) -> None:
    self.params = params

  def set_fit_loop(self, fit_loop) -> None:
    """The running `fit` (None in evaluate and predict)."""
    self.fit_loop = fit_loop

  def on_train_begin(self, logs=None): pass
  def on_train_end(self, logs=None): pass
  def on_epoch_begin(self, epoch: int, logs=None): pass
  def on_epoch_end(self, epoch: int, logs=None): pass
  def on_train_batch_begin(self, batch: int, logs=None): pass
  def on_train_batch_end(self, batch: int, logs=None): pass
  def on_test_begin(self, logs=None): pass
  def on_test_end(self, logs=None): pass
  def on_test_batch_begin(self, batch: int, logs=None): pass
  def on_test_batch_end(self, batch: int, logs=None): pass
  def on_predict_begin(self, logs=None): pass
  def on_predict_end(self, logs=None): pass
  def on_predict_batch_begin(self, batch: int, logs=None): pass
  def on_predict_batch_end(self, batch: int, logs=None): pass

  def close(self) -> None:
    """Frees what the callback holds when `fit` ends, also by an exception
    (unlike `on_train_end`). A jdist addition; default: nothing."""


class LazyLogs(collections.abc.MutableMapping):
  """A logs dict whose values are read from the devices on first access."""

  def __init__(self, read: Callable[[], dict]):
    self._read = read
    self._data = None

  def _get(self) -> dict:
    if self._data is None:
      self._data = dict(self._read())
    return self._data

  def __getitem__(self, key): return self._get()[key]
  def __setitem__(self, key, value): self._get()[key] = value
  def __delitem__(self, key): del self._get()[key]
  def __iter__(self): return iter(self._get())
  def __len__(self): return len(self._get())
  def __repr__(self): return repr(self._get())


_HOOKS = [name for name in vars(Callback) if name.startswith("on_")]

# Keras's callbacks with a jdist equivalent that takes their arguments.
_KERAS_EQUIVALENTS = {
    "EarlyStopping": "jdist.EarlyStopping",
    "ReduceLROnPlateau": "jdist.ReduceLROnPlateau",
    "LearningRateScheduler": "jdist.LearningRateScheduler",
    "CSVLogger": "jdist.CSVLogger",
    "TensorBoard": "jdist.TensorBoard",
    "TerminateOnNaN": "jdist.TerminateOnNaN",
    "BackupAndRestore": "jdist.BackupAndRestore",
    "ModelCheckpoint": "jdist.ModelCheckpoint",
}


def keras_callback_message(callback) -> str:
  """Why a Keras callback object cannot run in jdist's fit, and what can."""
  name = type(callback).__name__
  why = (f"{name} is a callback of Keras's own fit (keras.callbacks."
         "Callback), made for the Keras model that fit trains in place, its "
         "self.model; jdist.Trainer.fit trains the model's values on the "
         "devices and writes them into the model when it ends.")
  equivalent = _KERAS_EQUIVALENTS.get(name)
  if type(callback).__module__.startswith("keras.") and equivalent:
    extra = (" (its filepath a directory, where jdist saves each checkpoint;"
             " save the Keras file with model.save(...) after fit)"
             if name == "ModelCheckpoint" else "")
    return f"{why} Use {equivalent}, which takes the same arguments{extra}."
  return (f"{why} Subclass jdist.Callback instead: the same on_* hooks, with "
          "self.model the Trainer (trainer.optimizer.learning_rate, "
          "trainer.stop_training, trainer.params).")


def check_callbacks(callbacks) -> list:
  """`callbacks` as a list (None, as Keras takes it, is none).

  Raises:
    TypeError: one is a Keras callback or not a `jdist.Callback`.
  """
  callbacks = list(callbacks or ())
  for cb in callbacks:
    if keras_loading.is_callback(cb):
      raise TypeError(keras_callback_message(cb))
    if not isinstance(cb, Callback):
      raise TypeError(
          f"{cb!r} is not a jdist.Callback; subclass jdist.Callback and "
          "override its on_* hooks.")
  return callbacks


class CallbackList:
  """Calls a hook on every callback, in order."""

  def __init__(self, callbacks: Iterable[Callback], *, trainer, params: dict,
               fit_loop=None):
    self.callbacks = check_callbacks(callbacks)
    for cb in self.callbacks:
      cb.set_model(trainer)
      cb.set_params(params)
      cb.set_fit_loop(fit_loop)
    # Only hooks some callback overrides are dispatched: an unused per-batch
    # hook then costs nothing per step.
    self._active = {
        hook: [getattr(cb, hook) for cb in self.callbacks
               if getattr(type(cb), hook) is not getattr(Callback, hook)]
        for hook in _HOOKS}

  def call(self, hook: str, *args: Any) -> None:
    for fn in self._active[hook]:
      fn(*args)

  def overrides(self, hook: str) -> bool:
    """Whether some callback overrides `hook` (else calling it does nothing,
    and the logs made for it would go unread)."""
    return bool(self._active[hook])

  def close(self) -> None:
    """Calls every callback's `close` (at the end of `fit`, however it ends)."""
    for cb in self.callbacks:
      cb.close()
