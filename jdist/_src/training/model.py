"""What `Trainer` needs of a model: initialise it, apply it, hand it back.

Three kinds of model share one small interface (`init`, `apply`, `export`):
a flax linen `Module`, a flax nnx `Module`, or a plain apply function with
its parameters. `apply` is pure: it takes parameters and the model's other
state and returns predictions and the new state, so it runs inside a step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax


def _keyword(fn: Callable, names) -> str | None:
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return None
  return next((n for n in names if n in params), None)


class LinenModel:
  """A flax linen module: variables are `params` plus other collections.

  A `train` (or `training`) argument of `__call__` is set to True while
  training; a `deterministic` argument to its opposite. Collections other than
  `params` (such as `batch_stats`) are mutable while training. The step's key
  reaches the module as the "dropout" rng.
  """

  def __init__(self, module, variables=None):
    self.module = module
    self._given = None
    if variables is not None:
      variables = dict(variables)
      if "params" in variables:
        self._given = (variables.pop("params"), variables)
      else:
        self._given = (variables, {})
    self._train_kw = _keyword(module.__call__, ("train", "training"))
    self._det_kw = _keyword(module.__call__, ("deterministic",))

  def _mode(self, train: bool) -> dict:
    if self._train_kw:
      return {self._train_kw: train}
    if self._det_kw:
      return {self._det_kw: not train}
    return {}

  def init(self, key, x) -> tuple[Any, Any]:
    if self._given is not None:
      return self._given
    params_key, dropout_key = jax.random.split(key)
    variables = dict(self.module.init(
        {"params": params_key, "dropout": dropout_key}, x, **self._mode(False)))
    params = variables.pop("params", {})
    return params, variables

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    variables = {"params": params, **model_state}
    rngs = {"dropout": rng} if rng is not None else None
    if train and model_state:
      y, updates = self.module.apply(variables, x, rngs=rngs,
                                     mutable=list(model_state),
                                     **self._mode(True))
      return y, {**model_state, **updates}
    return self.module.apply(variables, x, rngs=rngs,
                             **self._mode(train)), model_state

  def export(self, params, model_state):
    """The trained variables, as `module.apply` takes them."""
    return {"params": params, **model_state}


class NnxModel:
  """A flax nnx module: `nnx.Param` leaves train, the rest is model state.

  The module is put in training mode (`module.train()`) for training steps
  and evaluation mode (`module.eval()`) otherwise. After `fit`, the trained
  state is written back into the module object, as Keras does.
  """

  def __init__(self, module):
    from flax import nnx
    self._nnx = nnx
    self.module = module
    self.graphdef, self._params, self._rest = nnx.split(module, nnx.Param, ...)

  def init(self, key, x) -> tuple[Any, Any]:
    del key, x  # an nnx module is built already
    return self._params, self._rest

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    del rng  # nnx modules carry their own Rngs
    nnx = self._nnx
    module = nnx.merge(self.graphdef, params, model_state, copy=True)
    if train:
      module.train()
    else:
      module.eval()
    y = module(x)
    _, _, new_state = nnx.split(module, nnx.Param, ...)
    return y, new_state

  def export(self, params, model_state):
    """Writes the trained state into the user's module and returns it."""
    self._nnx.update(self.module, params, model_state)
    return self.module


class FunctionModel:
  """`apply_fn(params, x)` with its parameters.

  `apply_fn` may take `train=` (True while training) and `rng=` (the step's
  key while training, None otherwise) as keyword arguments; it gets them if
  its signature names them.
  """

  def __init__(self, apply_fn: Callable, params):
    if params is None:
      raise ValueError(
          "A model given as an apply function needs its parameters: "
          "jdist.Trainer(apply_fn, params=params, ...). Flax modules are "
          "initialised by the trainer instead.")
    self.apply_fn = apply_fn
    self._params = params
    self._train_kw = _keyword(apply_fn, ("train", "training"))
    self._rng_kw = _keyword(apply_fn, ("rng", "key"))

  def init(self, key, x) -> tuple[Any, Any]:
    del key, x
    return self._params, {}

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    kwargs = {}
    if self._train_kw:
      kwargs[self._train_kw] = train
    if self._rng_kw:
      kwargs[self._rng_kw] = rng  # None outside training
    return self.apply_fn(params, x, **kwargs), model_state

  def export(self, params, model_state):
    del model_state
    return params


def adapt(model, params=None):
  """Wraps `model` in the adapter for its kind.

  Raises:
    TypeError: `model` is neither a flax module nor callable.
  """
  import flax.linen as nn
  from flax import nnx
  if isinstance(model, nn.Module):
    return LinenModel(model, params)
  if isinstance(model, nnx.Module):
    return NnxModel(model)
  if callable(model):
    return FunctionModel(model, params)
  raise TypeError(
      f"Cannot train a {type(model).__name__}: pass a flax linen Module, a flax "
      "nnx Module, or an apply function apply_fn(params, x) with params=.")
