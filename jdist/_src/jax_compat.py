"""Every use of a private or version-specific JAX API, in one place.

When JAX moves one of these, this file is the only one to change; each
function says why the public API does not suffice.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import jax
import jax.extend
import numpy as np
# Private modules, each used by one function below (see its docstring).
from jax._src import cloud_tpu_init
from jax._src import core as _core
from jax._src import clusters
from jax._src import distributed
from jax._src import mesh as mesh_lib
from jax._src import pjit
from jax._src import xla_bridge
from jax._src.clusters import cloud_tpu_cluster
from jax._src.lax.control_flow import loops as jax_loops
from jax._src.random import prng as jax_prng

# --- inside shard_map ----------------------------------------------------------


def varying_axes(x: Any) -> frozenset:
  """The mesh axes a traced value varies over inside `shard_map`.
  Version-specific: `jax.typeof(x).mat.varying` on 0.10, `.vma` before."""
  try:
    aval = jax.typeof(x)
  except TypeError:
    return frozenset()
  return aval_varying_axes(aval)


def aval_varying_axes(aval: Any) -> frozenset:
  """The mesh axes an abstract value (a jaxpr variable's aval) varies over."""
  mat = getattr(aval, "mat", None)
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


try:
  # Private: the public lax.all_gather returns a value typed as varying, but
  # every replica holds the same concatenation, and jdist's outputs are typed
  # by what varies. all_gather_invariant gives the invariant type directly.
  from jax._src.lax.parallel import all_gather_invariant
except ImportError:  # pragma: no cover - depends on the jax version
  all_gather_invariant = None

# --- a user's mesh context and sharding constraints --------------------------


def context_mesh():
  """The concrete mesh a user's `jax.set_mesh` put in context, or None.
  Private: the public `get_mesh()` refuses to answer inside `jax.jit`."""
  mesh = mesh_lib.get_concrete_mesh()
  return None if mesh is None or mesh.empty else mesh


def inside_trace() -> bool:
  """Whether JAX is tracing (where `jax.set_mesh` refuses to run); JAX's
  test for it is internal."""
  return not _core.trace_state_clean()


class _ConstraintMap(threading.local):
  """This thread's mapping of `with_sharding_constraint`'s shardings."""

  def __init__(self):
    super().__init__()
    self.mapper = None


_constraint_map = _ConstraintMap()
_prepare_shardings = pjit.prepare_axis_resources  # JAX's own


def _prepare_shardings_mapped(axis_resources, arg_name, *args, **kwargs):
  """JAX's `prepare_axis_resources`, a constraint's shardings mapped first."""
  mapper = _constraint_map.mapper
  if mapper is not None and arg_name == "shardings":  # with_sharding_constraint
    axis_resources = jax.tree.map(
        lambda x: x if x is None else mapper(x), axis_resources,
        is_leaf=lambda x: x is None or isinstance(
            x, (jax.sharding.PartitionSpec, jax.sharding.Sharding)))
  return _prepare_shardings(axis_resources, arg_name, *args, **kwargs)


@contextlib.contextmanager
def sharding_constraints_mapped(mapper: Callable | None) -> Iterator[None]:
  """In this thread, for the block: each sharding given to
  `jax.lax.with_sharding_constraint` is replaced by `mapper(sharding)`
  (None: kept as written).

  Private: a user's constraint, written for the global program, means per
  replica the spec without the replica axis, which JAX refuses inside a
  `shard_map`; the public API has no hook to map it.
  """
  pjit.prepare_axis_resources = _prepare_shardings_mapped
  previous, _constraint_map.mapper = _constraint_map.mapper, mapper
  try:
    yield
  finally:
    _constraint_map.mapper = previous

_NESTED_RESIDUALS_FIXED = []


def fix_nested_shard_map_residuals() -> None:
  """Lets autodiff go through a `shard_map` nested in another one.

  jax 0.10.2 gives a nested map's residuals an out spec naming the outer
  map's axis too (`ShapedArray.nospec`), which the compiler rejects; this
  leaves out the axes already manual outside the inner map. Specs of maps
  that are not nested are unchanged. Installed once.
  """
  if _NESTED_RESIDUALS_FIXED:
    return
  original = _core.ShapedArray.nospec

  def nospec(self, mesh, check_vma, all_names):
    spec = original(self, mesh, check_vma, all_names)
    outer = set(mesh_lib.get_abstract_mesh().manual_axes) - set(all_names)
    if not check_vma or not outer or not spec or spec[0] is None:
      return spec
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    kept = tuple(n for n in names if n not in outer)
    if kept == names:
      return spec
    return jax.sharding.PartitionSpec(
        (kept if len(kept) > 1 else kept[0]) if kept else None,
        unreduced=spec.unreduced, reduced=spec.reduced)

  _core.ShapedArray.nospec = nospec
  _NESTED_RESIDUALS_FIXED.append(original)


# --- rewriting a traced function ------------------------------------------------

# Primitives whose body is inlined by `eval_jaxpr_rewriting` (a call of a
# jitted function: inlining it computes the same, XLA inlines it too).
_CALLS = ("jit", "pjit", "closed_call", "core_call")
# `jax.checkpoint`'s primitive (its body is rewritten, the primitive kept:
# what it saves for the backward pass and recomputes does not change).
_CHECKPOINT = "remat2"


def _body(eqn):
  """The body of a jitted call (closed) or a `jax.checkpoint` (open), or None."""
  name = eqn.primitive.name
  body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if name in _CALLS and hasattr(body, "consts"):
    return body
  if name == _CHECKPOINT and hasattr(body, "eqns"):
    return body
  return None


def uses_primitives(jaxpr, primitives) -> bool:
  """Whether a jaxpr binds one of `primitives`, itself or in a body that
  `eval_jaxpr_rewriting` reaches into (private for the same reason)."""
  for eqn in jaxpr.eqns:
    body = _body(eqn)
    if eqn.primitive in primitives or (body is not None and uses_primitives(
        getattr(body, "jaxpr", body), primitives)):
      return True
  return False


def _rewritten_checkpoint(eqn, inputs, rules) -> list | None:
  """A `jax.checkpoint` equation bound with its body rewritten by `rules`, or
  None if that body needs constants."""
  body = jax.extend.core.ClosedJaxpr(eqn.params["jaxpr"], ())
  new = jax.make_jaxpr(
      lambda *xs: eval_jaxpr_rewriting(body, xs, rules))(*inputs)
  if new.consts:
    return None
  params = dict(eqn.primitive.get_bind_params(eqn.params), jaxpr=new.jaxpr)
  with eqn.ctx.manager:
    return eqn.primitive.bind(*inputs, **params)


def eval_jaxpr_rewriting(closed_jaxpr, args, rules: dict, *,
                         retype: bool = False) -> list:
  """Evaluates a `jax.make_jaxpr` result on its flat `args` in the current
  trace, binding `rules[primitive](*inputs, **params)` for each primitive
  `rules` names.

  Bodies that use such a primitive are rewritten too. With `retype`, a rule
  may return a value varying over more manual axes than the one it replaces
  (inputs are cast as tracing would). Private: JAX has no public way to
  replace a primitive while evaluating a jaxpr.
  """
  jaxpr = closed_jaxpr.jaxpr
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, closed_jaxpr.consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    inputs = [read(v) for v in eqn.invars]
    body = _body(eqn)
    outputs = None
    if body is not None and (
        (retype and hasattr(body, "consts")) or
        uses_primitives(getattr(body, "jaxpr", body), rules)):
      outputs = (eval_jaxpr_rewriting(body, inputs, rules, retype=retype)
                 if hasattr(body, "consts") else
                 _rewritten_checkpoint(eqn, inputs, rules))
    if outputs is None:
      bind = rules.get(eqn.primitive, eqn.primitive.bind)
      params = (eqn.params if eqn.primitive in rules else
                eqn.primitive.get_bind_params(eqn.params))
      if retype and eqn.primitive.name == "pvary":
        # The cast tracing inserted: now to the axes not varied over yet.
        bind, params = _pvary_remaining, {"axes": params["axes"]}
      elif retype and eqn.primitive not in rules:
        if _has_bodies(eqn):
          outputs = _bind_with_bodies(eqn, inputs, rules)
        else:
          inputs = _varying_alike(inputs)
      if outputs is None:
        with eqn.ctx.manager:
          outputs = bind(*inputs, **params)
        if not eqn.primitive.multiple_results:
          outputs = [outputs]
    env.update(zip(eqn.outvars, outputs))
  return [read(v) for v in jaxpr.outvars]


def _has_bodies(eqn) -> bool:
  """Whether an equation's parameters hold jaxprs (a loop's, a branch's,
  a custom derivative's primal)."""
  kinds = (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)
  for value in eqn.params.values():
    values = value if isinstance(value, tuple) else (value,)
    if any(isinstance(v, kinds) for v in values):
      return True
  return False


def _bind_with_bodies(eqn, inputs, rules) -> list | None:
  """An equation with bodies, under `eval_jaxpr_rewriting(retype=True)`.

  Inputs typed as they were traced: None (bound as they are, their bodies
  typed for them). Inputs that vary over more axes (a rewritten draw flows
  in): a loop or a branch is traced again from its bodies, rewritten, with
  its carries cast to varying where they come to vary; a custom
  derivative's primal is inlined (differentiated as written).

  Raises:
    NotImplementedError: another primitive with bodies gets such inputs.
  """
  traced = [aval_varying_axes(getattr(v, "aval", None)) for v in eqn.invars]
  if all(varying_axes(x) <= t for x, t in zip(inputs, traced)):
    return None
  name = eqn.primitive.name
  retrace = _RETRACE.get(name)
  if retrace is not None:
    with varying_loop_carries():
      return list(retrace(eqn.params, inputs, rules))
  primal = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
  if name.startswith("custom_") and hasattr(primal, "consts"):
    return eval_jaxpr_rewriting(primal, inputs, rules, retype=True)
  raise NotImplementedError(
      f"jdist cannot rewrite a `{name}` whose inputs come to vary over more "
      "replicas than when it was traced (a random draw over the global batch "
      "flows into it). Draw the random values outside it.")


def _body_fn(closed, consts, rules):
  def fn(*args):
    return eval_jaxpr_rewriting(closed, [*consts, *args], rules, retype=True)
  return fn


def _retraced_scan(params, inputs, rules):
  nc, nk = params["num_consts"], params["num_carry"]
  consts, init, xs = inputs[:nc], inputs[nc:nc + nk], inputs[nc + nk:]
  body = _body_fn(params["jaxpr"], consts, rules)

  def step(carry, x):
    out = body(*carry, *x)
    return out[:nk], out[nk:]
  carry, ys = jax.lax.scan(step, list(init), list(xs), length=params["length"],
                           reverse=params["reverse"], unroll=params["unroll"])
  return [*carry, *ys]


def _retraced_while(params, inputs, rules):
  cn, bn = params["cond_nconsts"], params["body_nconsts"]
  cond = _body_fn(params["cond_jaxpr"], inputs[:cn], rules)
  body = _body_fn(params["body_jaxpr"], inputs[cn:cn + bn], rules)
  return jax.lax.while_loop(lambda c: cond(*c)[0], lambda c: body(*c),
                            list(inputs[cn + bn:]))


def _retraced_cond(params, inputs, rules):
  branches = [_body_fn(b, (), rules) for b in params["branches"]]
  return jax.lax.switch(inputs[0], branches, *inputs[1:])


# Loops and branches traced again by `_bind_with_bodies`, by primitive name.
_RETRACE = {"scan": _retraced_scan, "while": _retraced_while,
            "cond": _retraced_cond}


def _varying_alike(values: list) -> list:
  """`values` cast to vary over every manual axis any of them varies over."""
  axes = [varying_axes(v) for v in values]
  union = frozenset().union(*axes)
  return [v if a == union or not hasattr(v, "shape") else
          jax.lax.pcast(v, tuple(sorted(union - a)), to="varying")
          for v, a in zip(values, axes)]


def _pvary_remaining(*values, axes):
  """`pvary` of `values` to those of `axes` each does not vary over yet."""
  out = []
  for v in values:
    rest = tuple(a for a in axes if a not in varying_axes(v))
    out.append(jax.lax.pcast(v, rest, to="varying") if rest else v)
  return out if len(values) > 1 else out[0]


_promote_weak_typed = jax_loops._promote_weak_typed_input
_carry_lock = threading.Lock()
_carry_users = 0


def _promote_or_vary(in_val, in_aval, out_aval):
  """JAX's promotion of a loop's weakly typed initial carry, and a cast of
  an initial carry to varying over the manual axes its body's output
  varies over (what `lax.scan`'s message asks the caller to write)."""
  in_val, changed = _promote_weak_typed(in_val, in_aval, out_aval)
  extra = aval_varying_axes(out_aval) - aval_varying_axes(in_aval)
  if extra and hasattr(in_val, "shape"):
    return jax.lax.pcast(in_val, tuple(sorted(extra)), to="varying"), True
  return in_val, changed


@contextlib.contextmanager
def varying_loop_carries() -> Iterator[None]:
  """While open, `lax.scan` and `lax.while_loop` traced inside `shard_map`
  cast an initial carry to varying where their body makes it vary.

  `shard_map` refuses a loop started from constants (Keras's LSTM) whose
  carry varies; this widens JAX's weak-type promotion pass
  (`loops._promote_weak_typed_input`, no public hook) to the carry's varying
  axes. Counted, for nested users.
  """
  global _carry_users
  with _carry_lock:
    _carry_users += 1
    jax_loops._promote_weak_typed_input = _promote_or_vary
  try:
    yield
  finally:
    with _carry_lock:
      _carry_users -= 1
      if not _carry_users:
        jax_loops._promote_weak_typed_input = _promote_weak_typed


def random_bits_primitive():
  """The primitive every draw of random bits from a key binds, which a rule of
  `eval_jaxpr_rewriting` is keyed by (the public API does not name it)."""
  return jax_prng.random_bits_p


# --- the distributed runtime ------------------------------------------------------


def distributed_state():
  """JAX's process-wide distributed state. Private: the public API does not
  give the coordination service's client (jdist's rendezvous use its store).
  """
  return distributed.global_state


def backends_are_initialized() -> bool:
  """Whether JAX has started its backends (private: no public call answers
  this without starting them)."""
  return xla_bridge.backends_are_initialized()


def cluster_environments() -> list:
  """JAX's cluster detectors (SLURM, Open MPI, Kubernetes, Cloud TPU, ...),
  which `jax.distributed.initialize` does not expose."""
  return list(clusters.ClusterEnv._cluster_types)


def is_cloud_tpu_cluster(env) -> bool:
  """Whether a detector found by `cluster_environments` is a Cloud TPU's."""
  return isinstance(env, type) and issubclass(env, cloud_tpu_cluster.BaseTpuCluster)


def running_in_cloud_tpu_vm() -> bool:
  """Whether this process runs on a Cloud TPU VM (private flag of JAX's)."""
  return bool(cloud_tpu_init.running_in_cloud_tpu_vm)

# --- placing host batches ---------------------------------------------------------

try:
  # Private: jax.device_put's Python per leaf (pytree and sharding checks,
  # copy semantics, aval updates) dominates a small model's input path.
  # These are the calls it ends in.
  from jax._src import core as _core
  from jax._src import dispatch as _dispatch
  from jax._src.interpreters import pxla as _pxla
except ImportError:  # pragma: no cover - depends on the jax version
  _pxla = None

try:
  from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover - depends on the jax version
  _ArrayImpl = None


def array_type() -> type | None:
  """`ArrayImpl`, or None: `type(x) is array_type()` is cheaper than
  `isinstance(x, jax.Array)` (through `abc`), asked at every step's call."""
  return _ArrayImpl


# (sharding, shape, dtype) -> the shards' indices and the arrays' abstract
# value (building the value costs more than placing a small leaf).
_host_puts: dict = {}


def put_host_arrays(xs: list, sharding) -> list:
  """`jax.device_put(xs, sharding)` for numpy arrays in one process, at a
  fraction of its Python cost per leaf, with the same arrays as a result;
  anything else goes through `jax.device_put`."""
  if _pxla is None:
    return jax.device_put(xs, sharding)
  known = []
  for x in xs:
    if type(x) is not np.ndarray:
      return jax.device_put(xs, sharding)
    key = (sharding, x.shape, x.dtype)
    entry = _host_puts.get(key)
    if entry is None:
      if jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype:
        return jax.device_put(xs, sharding)  # jax converts it: its path
      entry = _host_puts[key] = (
          tuple(sharding.addressable_devices_indices_map(x.shape).values()),
          _dispatch.update_dp_aval(_core.shaped_abstractify(x), sharding))
    known.append(entry)
  # `pxla.batched_device_put` without its wrapper (two test hooks and a scan
  # for jax arrays among the shards: these are numpy's).
  put, devices = _pxla.xc.batched_device_put, list(
      sharding._addressable_device_assignment)
  return [put(aval, sharding, [x[i] for i in indices], devices, True)
          for x, (indices, aval) in zip(xs, known)]
