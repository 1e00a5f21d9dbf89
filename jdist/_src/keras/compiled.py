"""What `jdist.Trainer` takes from a Keras model the user compiled.

Every argument the Trainer is not given is taken from the model's compile;
one given to both with different values, or a compile option jdist cannot
honour (`run_eagerly=True`, `jit_compile=False`), is an error
(docs/keras.md).
"""

from __future__ import annotations

from typing import Any

from jdist._src.keras import loading

# The compile arguments the Trainer takes, with the Trainer's defaults.
TAKEN = {"optimizer": None, "loss": None, "loss_weights": None,
         "metrics": None, "weighted_metrics": None,
         "steps_per_execution": None}


def _compiled(model) -> dict | None:
  """The model's compile arguments, or None if it was not compiled."""
  if not loading.is_model(model) or not getattr(model, "compiled", False):
    return None
  config = loading.compile_arguments(model)
  if config.get("run_eagerly"):
    raise ValueError(
        "The Keras model was compiled with run_eagerly=True; jdist.Trainer "
        "compiles its steps (a step runs inside jax.jit and shard_map). "
        "Compile it without run_eagerly, or debug with jax.disable_jit().")
  if config.get("jit_compile") is False:
    raise ValueError(
        "The Keras model was compiled with jit_compile=False; jdist.Trainer "
        "compiles its steps with XLA. Compile it without jit_compile=False.")
  keras = loading.keras_module("A compiled Keras model")
  optimizer = model.optimizer
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    # compile wraps it under mixed_float16; the Trainer scales the loss
    # itself for that policy (the model's).
    optimizer = optimizer.inner_optimizer
  taken = {k: config.get(k) for k in TAKEN}
  taken["optimizer"] = optimizer
  if taken["steps_per_execution"] == 1:
    taken["steps_per_execution"] = None
  return taken


def _same(a, b) -> bool:
  if a is b:
    return True
  try:
    return bool(a == b)
  except Exception:  # arrays, objects without equality: not the same
    return False


def arguments(model, given: dict) -> dict:
  """The Trainer's arguments `given` (keys of `TAKEN`, None: not given),
  completed from the Keras model's compile.

  Raises:
    TypeError: no optimizer or no loss, given or compiled.
    ValueError: an argument given differs from the compile's, or the compile
      used an option jdist cannot honour.
  """
  compiled = _compiled(model)
  out = dict(given)
  if compiled is not None:
    for name, value in compiled.items():
      mine = given.get(name)
      if value is None:
        continue
      if mine is not None and not _same(mine, value) and not (
          name == "optimizer" and _same(mine, model.optimizer)):
        raise ValueError(
            f"The Keras model was compiled with {name}={_show(value)}, and "
            f"jdist.Trainer was given {name}={_show(mine)}. The Trainer takes "
            f"the model's compile: pass {name} to one of them only (or "
            "compile the model again with the one to train with).")
      out[name] = value
  missing = [n for n in ("optimizer", "loss") if out.get(n) is None]
  if missing:
    raise TypeError(
        f"jdist.Trainer needs {' and '.join(f'{n}=' for n in missing)}: pass "
        f"{'them' if len(missing) > 1 else 'it'} to the Trainer"
        + (", or compile the Keras model with them first"
           if loading.is_model(model) else "") + ".")
  return out


def _show(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."
