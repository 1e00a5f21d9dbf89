"""`History`: the per-epoch logs a `fit` returns."""

from __future__ import annotations

from jdist._src.training.callbacks import Callback


class History(Callback):
  """Records each epoch's logs; `Trainer.fit` returns it.

  It records the logs mapping itself, so values later callbacks add are
  recorded too, as in Keras.

  Attributes:
    history: `{name: [value per epoch]}` (floats, exact epoch means).
    epoch: the epoch indices recorded, in order.

  Example:
    >>> import jdist
    >>> h = jdist.History()
    >>> h.on_epoch_end(0, {"loss": 0.5})
    >>> h.history
    {'loss': [0.5]}
  """

  def __init__(self):
    super().__init__()
    self.epoch: list[int] = []
    self._logs: list = []

  @property
  def history(self) -> dict[str, list]:
    out: dict[str, list] = {}
    for logs in self._logs:
      for key, value in logs.items():
        out.setdefault(key, []).append(value)
    return out

  def on_epoch_end(self, epoch: int, logs=None):
    self.epoch.append(epoch)
    self._logs.append(logs if logs is not None else {})

  def to_dict(self) -> dict:
    """A JSON-able copy (used by checkpoints to restore the history)."""
    return {"epoch": list(self.epoch), "history": self.history}

  def load_dict(self, data: dict) -> None:
    """Replaces the records by those of `to_dict()`."""
    self.epoch = list(data.get("epoch", []))
    history = data.get("history", {})
    self._logs = [{} for _ in self.epoch]
    for key, values in history.items():
      # Keys missing from early epochs are missing from the start, as recorded.
      for logs, value in zip(self._logs[len(self.epoch) - len(values):], values):
        logs[key] = value

  def __repr__(self) -> str:
    return f"History(epochs={len(self.epoch)}, keys={sorted(self.history)})"
