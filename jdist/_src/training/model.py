"""What `Trainer` needs of a model: initialise it, apply it, hand it back.

Every kind of model (flax linen or nnx, Keras 3, an apply function) reaches
the training program through `adapt`, as a `ModelAdapter` whose `apply` is
pure, so it runs inside a step. flax's BatchNorm given no `axis_name` gets
the replica axis: global-batch statistics, as on one device (docs/fit.md).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jdist._src.core import context
from jdist._src.core import in_step
from jdist._src.keras import loading as keras_loading
from jdist._src.keras.model import StatelessModel
from jdist._src.strategies import output_layouts


def _parameters(fn: Callable):
  try:
    return inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return None


def _keyword(fn: Callable, names) -> str | None:
  params = _parameters(fn)
  if params is None:
    return None
  return next((n for n in names if n in params), None)


def check_call(fn: Callable, kwargs: dict, what: str) -> None:
  """Raises a clear TypeError if `fn(x, **kwargs)` does not fit `fn`."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return
  try:
    sig.bind(None, **kwargs)
  except TypeError as e:
    passed = ", ".join(["x"] + [f"{k}=..." for k in kwargs])
    raise TypeError(
        f"The trainer calls the {what} as ({passed}), which its signature "
        f"{sig} does not accept: {e}. The trainer passes the inputs x, and by "
        "name: train/training (True while training), deterministic or "
        "use_running_average (their opposite), and rngs (flax nnx: an "
        "nnx.Rngs while training, None otherwise) or rng/key (apply "
        "functions) when the signature names them. Give the other "
        "parameters defaults.") from None


def _replica_axis() -> str | None:
  """The replica axis of the running step, if it has more than one replica."""
  ctx = context.current_replica_context()
  if ctx is None or ctx.num_replicas_in_sync == 1:
    return None
  return ctx.axis_name


@contextlib.contextmanager
def _global_linen_batch_norm(axis: str | None):
  """Gives linen BatchNorm layers without `axis_name` the replica axis."""
  if axis is None:
    yield
    return
  import flax.linen as nn  # a linen model's: flax is imported

  def interceptor(next_fun, args, kwargs, ctx):
    module = ctx.module
    if (ctx.method_name != "__call__" or not isinstance(module, nn.BatchNorm)
        or module.axis_name is not None):
      return next_fun(*args, **kwargs)
    # The module is this call's own instance (linen builds it per apply).
    object.__setattr__(module, "axis_name", axis)
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(module, "axis_name", None)

  with nn.intercept_methods(interceptor):
    yield


def _global_nnx_batch_norm(module, axis: str | None) -> None:
  """Gives nnx BatchNorm layers without `axis_name` the replica axis."""
  if axis is None:
    return
  from flax import nnx  # an nnx model's: flax is imported
  for _, sub in nnx.iter_modules(module):
    if isinstance(sub, nnx.BatchNorm) and sub.axis_name is None:
      sub.axis_name = axis


def _mode_kwargs(fn: Callable, train: bool) -> dict:
  params = _parameters(fn) or {}
  kwargs = {}
  for name in ("train", "training"):
    if name in params:
      kwargs[name] = train
      break
  else:
    for name in ("deterministic", "use_running_average"):
      if name in params:
        kwargs[name] = not train
        break
  return kwargs


def open_boxes(tree: Any) -> Any:
  """`tree` with flax linen's metadata boxes replaced by their values
  (without the sharding constraint `unbox` applies under a mesh)."""
  if "flax.core" not in sys.modules:  # no flax, no boxes
    return tree
  from flax.core import meta

  def open_(x):
    if isinstance(x, meta.Partitioned):
      return x.unbox(apply_constraint=False)
    return x.unbox() if isinstance(x, meta.AxisMetadata) else x
  return jax.tree.map(open_, tree, is_leaf=meta.is_axis_metadata)


def _rebox(old: Any, new: Any) -> Any:
  """`new` (a collection linen returned unboxed) in `old`'s boxes, if any."""
  from flax.core import meta  # a linen model's: flax is imported
  if not any(map(meta.is_axis_metadata,
                 jax.tree.leaves(old, is_leaf=meta.is_axis_metadata))):
    return new
  return meta.replace_boxed(old, new)


class ModelAdapter:
  """The interface every model adapter offers the training program.

  Attributes:
    writes_back: `fit` writes the trained values back into the model object
      (`export`), as for models that hold their variables (nnx, Keras).
    own_losses: the model adds losses of its own (Keras' regularizers):
      `apply` returns their sum third, added to the loss.
    dtype_policy: the policy the model computes under by itself (a Keras
      model's), or None: jdist casts for it.
    output_names: the names of the model's outputs, or None.
  """

  writes_back = False
  own_losses = False
  dtype_policy = None
  output_names = None

  def check(self) -> None:
    """Raises if the model cannot be called the way the trainer calls it."""

  def init(self, key, x) -> tuple[Any, Any]:
    """`(params, model_state)` for inputs like `x` (one example)."""
    raise NotImplementedError

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    """`(predictions, new model_state)`; pure, so it runs inside a step."""
    raise NotImplementedError

  def export(self, params, model_state) -> Any:
    """The trained model in its own terms (see `Trainer.export`)."""
    raise NotImplementedError


class LinenModel(ModelAdapter):
  """A flax linen module: variables are `params` plus other collections.

  `train`/`training` (or `deterministic`) arguments get the mode; other
  collections are mutable while training; the step's key is the "dropout"
  rng.
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

  def _mode(self, train: bool) -> dict:
    return _mode_kwargs(self.module.__call__, train)

  def check(self) -> None:
    """Raises if the module cannot be called the way the trainer calls it."""
    check_call(self.module.__call__, self._mode(True), "model's __call__")

  def init(self, key, x) -> tuple[Any, Any]:
    if self._given is not None:
      return self._given
    params_key, dropout_key = jax.random.split(key)
    variables = dict(self.module.init(
        {"params": params_key, "dropout": dropout_key}, x, **self._mode(False)))
    params = variables.pop("params", {})
    return params, variables

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    # Opened here, so that linen applies no sharding constraint of its own:
    # the strategy has laid the state out already (from these boxes, under
    # ModelParallelStrategy), and under another strategy the boxes' mesh
    # axes are not the mesh's.
    variables = open_boxes({"params": params, **model_state})
    rngs = {"dropout": rng} if rng is not None else None
    if train and model_state:
      with _global_linen_batch_norm(_replica_axis()):
        y, updates = self.module.apply(variables, x, rngs=rngs,
                                       mutable=list(model_state),
                                       **self._mode(True))
      # Boxed again as they came in: the state keeps its structure.
      return y, {**model_state, **{k: _rebox(model_state[k], v)
                                   for k, v in updates.items()}}
    with _global_linen_batch_norm(_replica_axis() if train else None):
      y = self.module.apply(variables, x, rngs=rngs, **self._mode(train))
    return y, model_state

  def export(self, params, model_state):
    """The trained variables, as `module.apply` takes them."""
    return {"params": params, **model_state}


class NnxModel(ModelAdapter):
  """A flax nnx module: `nnx.Param` leaves train, the rest is model state.

  `module.train()` / `module.eval()` set the mode; an `rngs` parameter gets
  an `nnx.Rngs` of the step's key while training (docs/fit.md). `fit`
  writes the trained state back into the module.
  """

  writes_back = True

  def __init__(self, module):
    from flax import nnx  # an nnx model: flax is imported
    self._nnx = nnx
    self.module = module
    self.graphdef, self._params, self._rest = nnx.split(module, nnx.Param, ...)
    self._takes_rngs = "rngs" in (_parameters(module.__call__) or {})

  def _kwargs(self, train: bool, rng) -> dict:
    kwargs = _mode_kwargs(self.module.__call__, train)
    if self._takes_rngs:
      kwargs["rngs"] = self._nnx.Rngs(rng) if train and rng is not None else None
    return kwargs

  def check(self) -> None:
    """Raises if the module cannot be called the way the trainer calls it."""
    check_call(self.module.__call__, self._kwargs(True, None),
               "model's __call__")

  def init(self, key, x) -> tuple[Any, Any]:
    del key, x  # an nnx module is built already
    return self._params, self._rest

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    nnx = self._nnx
    module = nnx.merge(self.graphdef, params, model_state, copy=True)
    if train:
      module.train()
      _global_nnx_batch_norm(module, _replica_axis())
    else:
      module.eval()
    with output_layouts.nnx_outputs(module):
      y = module(x, **self._kwargs(train, rng))
    _, _, new_state = nnx.split(module, nnx.Param, ...)
    return y, new_state

  def export(self, params, model_state):
    """Writes the trained state into the user's module and returns it."""
    self._nnx.update(self.module, params, model_state)
    return self.module


class FunctionModel(ModelAdapter):
  """`apply_fn(params, x)` with its parameters.

  `apply_fn` gets `train=` and `rng=` (the step's key while training) if
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
    self._rng_kw = _keyword(apply_fn, ("rng", "key"))

  def init(self, key, x) -> tuple[Any, Any]:
    del key, x
    return self._params, {}

  def _kwargs(self, train: bool, rng) -> dict:
    kwargs = _mode_kwargs(self.apply_fn, train)
    if self._rng_kw:
      kwargs[self._rng_kw] = rng  # None outside training
    return kwargs

  def check(self) -> None:
    """Raises if the function cannot be called the way the trainer calls it."""
    try:
      sig = inspect.signature(self.apply_fn)
      sig.bind(None, None, **self._kwargs(True, None))
    except ValueError:
      return
    except TypeError as e:
      raise TypeError(
          f"The trainer calls the apply function as apply_fn(params, x, "
          f"...), which its signature {sig} does not accept: {e}.") from None

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    return self.apply_fn(params, x, **self._kwargs(train, rng)), model_state

  def export(self, params, model_state):
    del model_state
    return params


class KerasModel(ModelAdapter):
  """A Keras 3 model (JAX backend), through its stateless API.

  Trainable variables are the parameters, the others the model state,
  keyed by `variable.path`; random layers draw from their seed states, not
  the step's `rng` (docs/keras.md). `fit` writes the values back.
  """

  writes_back = True

  def __init__(self, model, params=None):
    if params is not None:
      raise ValueError(
          "A Keras model holds its own variables: pass the model alone "
          "(jdist.Trainer(model, ...)), without params=; set its weights "
          "with model.set_weights(...) first to start from others.")
    self.model = StatelessModel(model)
    self._warned = False

  def check(self) -> None:
    """Keras models take `training=`; nothing to check ahead."""

  @property
  def dtype_policy(self) -> str:
    """The name of the dtype policy the model computes under (its own)."""
    return self.model.model.dtype_policy.name

  @property
  def output_names(self) -> list[str] | None:
    """Keras's names of the model's outputs; None where it has none."""
    return getattr(self.model.model, "output_names", None) or None

  def init(self, key, x) -> tuple[Any, Any]:
    del key  # Keras initialises its variables itself (keras.utils.set_random_seed)
    self.model.build(x)
    return self.model.variables()

  @property
  def own_losses(self) -> bool:
    """Whether the model adds losses of its own (`model.losses`)."""
    return self.model.has_losses

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    del rng  # Keras's random layers draw from their seed generators' state
    y, new_state, losses = self.model.apply(params, model_state, x,
                                            training=train)
    if train:
      self._warn_varying(model_state, new_state)
    if not self.own_losses:
      return y, new_state
    return y, new_state, sum(losses, jnp.zeros((), jnp.float32))

  def _warn_varying(self, old_state, new_state) -> None:
    """Warns once when a step's non-trainable floats differ by replica."""
    axis = _replica_axis()
    if axis is None or self._warned:
      return
    old = jax.tree.leaves(old_state)
    flat = jax.tree_util.tree_flatten_with_path(new_state)[0]
    names = [jax.tree_util.keystr(path) for (path, v), before in zip(flat, old)
             if v is not before and jnp.issubdtype(v.dtype, jnp.inexact)
             and in_step.is_varying(v, axis)]
    if names:
      self._warned = True
      warnings.warn(
          f"The Keras model's non-trainable variables {names[:4]} differ "
          "between replicas after a training step: each replica normalises "
          "with its own batch's statistics (BatchNormalization's "
          "synchronized=False, as under TensorFlow's MirroredStrategy), so "
          "training differs from one device; the trainer keeps their mean "
          "over replicas. Keras on JAX has no synchronized batch "
          "normalisation; a larger batch per replica narrows the gap.",
          stacklevel=2)

  def export(self, params, model_state):
    """Writes the trained values into the Keras model and returns it."""
    self.model.assign(params, model_state)
    return self.model.model


def adapt(model, params=None):
  """Wraps `model` in the adapter for its kind.

  Raises:
    TypeError: `model` is neither a flax module nor callable.
  """
  # A Keras model's class comes from keras, so keras is imported if it is
  # one (and a flax module's from flax).
  if keras_loading.is_model(model):
    return KerasModel(model, params)
  linen, nnx = sys.modules.get("flax.linen"), sys.modules.get("flax.nnx")
  if linen is not None and isinstance(model, linen.Module):
    return LinenModel(model, params)
  if nnx is not None and isinstance(model, nnx.Module):
    return NnxModel(model)
  if callable(model):
    return FunctionModel(model, params)
  raise TypeError(
      f"Cannot train a {type(model).__name__}: pass a flax linen Module, a flax "
      "nnx Module, or an apply function apply_fn(params, x) with params=.")
