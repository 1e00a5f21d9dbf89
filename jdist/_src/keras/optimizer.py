"""A Keras optimizer as an optax `GradientTransformation`.

`update` runs Keras's `stateless_apply` and returns `new_params - params`,
so it composes with loss scaling, accumulation and `ShardedOptimizer`. Slots
sit under the parameter's path, so a `LayoutMap` rule lays them out too.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import jax
import numpy as np
import optax

from jdist._src.keras import loading
from jdist._src.keras import variables as variables_lib
from jdist._src.strategies.partition_metadata import path_name


def _refuse_unsupported(optimizer) -> None:
  """Raises for the Keras optimizer options jdist provides otherwise."""
  keras = loading.keras_module("A Keras optimizer")
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    raise ValueError(
        "A keras LossScaleOptimizer scales the loss inside Keras's own fit; "
        "jdist.Trainer does it itself: pass the inner optimizer "
        "(loss_scale_optimizer.inner_optimizer) with "
        "dtype_policy=\"mixed_float16\", or wrap an optimizer in "
        "jdist.loss_scale_optimizer.")
  if optimizer.gradient_accumulation_steps:
    raise ValueError(
        f"The Keras optimizer has gradient_accumulation_steps="
        f"{optimizer.gradient_accumulation_steps}; jdist accumulates in the "
        "Trainer: build the optimizer without it and pass "
        f"jdist.Trainer(..., gradient_accumulation_steps="
        f"{optimizer.gradient_accumulation_steps}) (the same meaning: that "
        "many batches per optimizer step).")
  if optimizer.use_ema:
    raise ValueError(
        "The Keras optimizer has use_ema=True: Keras's fit swaps the moving "
        "average into the model at its end, which the optax form of the "
        "optimizer cannot do. Build it without use_ema (an optax "
        "transformation such as optax.ema can keep an average instead).")


def resolve(optimizer) -> optax.GradientTransformation:
  """The optax transformation of a Keras optimizer object or name ("adam");
  ImportError without keras, ValueError for an unknown name or an option
  jdist provides in the Trainer instead.

  Example:
    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import jax.numpy as jnp
    >>> from jdist._src.keras import optimizer as keras_optimizer
    >>> tx = keras_optimizer.resolve("sgd")   # Keras's SGD: learning rate 0.01
    >>> params = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    >>> updates["w"].round(4)
    Array([-0.01, -0.01], dtype=float32)
  """
  return KerasOptimizer.of(optimizer).transformation()


def _placeholder(keras, path: str, shape: tuple, dtype) -> Any:
  """A Keras variable at `path` (its slots are named after the path)."""
  *scopes, name = path.split("/")
  with contextlib.ExitStack() as stack:
    for scope in scopes:
      stack.enter_context(keras.name_scope(scope))
    return keras.Variable(np.zeros(shape, dtype), name=name, trainable=True)


class KerasOptimizer:
  """A Keras optimizer's configuration (read from the user's optimizer,
  whose own variables are left alone), built for each set of shapes."""

  @classmethod
  def of(cls, optimizer) -> "KerasOptimizer":
    """The `KerasOptimizer` of a Keras optimizer object or name (errors as
    `resolve`)."""
    keras = loading.keras_module(f"The optimizer {optimizer!r}")
    if isinstance(optimizer, str):
      try:
        optimizer = keras.optimizers.get(optimizer)
      except ValueError:
        raise ValueError(
            f"Unknown optimizer {optimizer!r}: not a Keras optimizer's name "
            "(such as 'adam', 'sgd', 'rmsprop', 'adamw'). Pass an optax "
            "GradientTransformation or a keras.optimizers object.") from None
    _refuse_unsupported(optimizer)
    return cls(optimizer)

  def __init__(self, optimizer):
    self._keras = loading.keras_module("A Keras optimizer")
    self._cls = type(optimizer)
    with warnings.catch_warnings():
      # Keras 3.15 reads its learning rate with np.array(variable), which
      # numpy 2 flags as deprecated: Keras's, not the user's, concern.
      warnings.simplefilter("ignore", DeprecationWarning)
      self._config = optimizer.get_config()
    self.name = self._config.get("name", self._cls.__name__)
    # (paths, shapes, dtypes) -> (built optimizer, state keys)
    self._built: dict = {}
    self._keys = None  # the state keys of the first build, for every other

  def _build(self, paths: tuple, shapes: tuple, dtypes: tuple):
    """The optimizer built for parameters of these paths, shapes, dtypes."""
    signature = (paths, shapes, dtypes)
    if signature not in self._built:
      keras = self._keras
      # Its own variables are never read (stateless_apply is given the
      # state): they are made in host memory, not on an accelerator.
      with loading.no_distribution(), jax.ensure_compile_time_eval(), \
          jax.default_device(jax.local_devices(backend="cpu")[0]):
        optimizer = self._cls.from_config(dict(self._config))
        placeholders = [_placeholder(keras, p, s, d)
                        for p, s, d in zip(paths, shapes, dtypes)]
        optimizer.build(placeholders)
      keys = _state_keys(optimizer, paths, shapes)
      if self._keys is not None and keys != self._keys:
        raise ValueError(
            f"The Keras optimizer {self.name!r} keeps different variables "
            f"for parameters of other shapes ({sorted(set(keys) ^ set(self._keys))[:4]}): "
            "its update is not one it can apply to blocks of the parameters. "
            "Use it with shard_optimizer_state=False.")
      self._keys = keys
      self._built[signature] = (optimizer, keys)
    return self._built[signature]

  def transformation(self) -> optax.GradientTransformation:
    """The optax form: `init(params)`, `update(grads, state, params)`."""
    return optax.GradientTransformation(self.init, self.update)

  def init(self, params) -> dict:
    """The optimizer's variables, fresh, for `params`."""
    names, leaves, _ = _flat(params)
    optimizer, keys = self._build(*_signature(names, leaves))
    values = [np.asarray(v.value) for v in optimizer.variables]
    return variables_lib.tree_of(keys, values)

  def apply(self, grads, state, params) -> tuple[Any, dict]:
    """Keras's step, `optimizer.stateless_apply`: `(new_params, new_state)`."""
    names, leaves, treedef = _flat(params)
    optimizer, keys = self._build(*_signature(names, leaves))
    grad_leaves = treedef.flatten_up_to(grads)
    values = variables_lib.at_paths(state, keys, "optimizer state")
    new_params, new_values = optimizer.stateless_apply(
        values, grad_leaves, leaves)
    return (jax.tree.unflatten(treedef, new_params),
            variables_lib.tree_of(keys, new_values))

  def update(self, grads, state, params=None):
    """Keras's step as optax's: `(new_params - params, new_state)`."""
    if params is None:
      raise ValueError(
          f"The Keras optimizer {self.name!r} needs the parameters: call "
          "update(grads, state, params).")
    new_params, new_state = self.apply(grads, state, params)
    return jax.tree.map(lambda new, old: new - old, new_params, params), new_state


def _flat(params):
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  names = [path_name(p) for p, _ in flat]
  variables_lib.check_paths(names, "parameters")
  return names, [x for _, x in flat], treedef


def _signature(names, leaves) -> tuple:
  return (tuple(names), tuple(tuple(np.shape(x)) for x in leaves),
          tuple(np.dtype(x.dtype).name for x in leaves))


def _state_keys(optimizer, paths, shapes) -> list[str]:
  """Where each optimizer variable sits in the state: a slot at
  `slot/<parameter path>`, any other by its name."""
  prefixes = sorted(((p.replace("/", "_") + "_", p, s)
                     for p, s in zip(paths, shapes)),
                    key=lambda t: -len(t[0]))
  keys = []
  for v in optimizer.variables:
    for prefix, path, shape in prefixes:
      if v.name.startswith(prefix) and tuple(v.shape) == shape:
        keys.append(f"{v.name[len(prefix):]}/{path}")
        break
    else:
      keys.append(v.name)
  variables_lib.check_paths(keys, "optimizer's variables")
  return keys
