"""Running one training on two strategies and comparing what came out."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import jax
import numpy as np

from jdist._src.core import kinds
from jdist._src.core import placement
from jdist._src.core.reduce_op import ReduceOp
from jdist._src.core.values import read_value
from jdist._src.strategies.mirrored import MirroredStrategy, OneDeviceStrategy


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """What a training run produced, on the host: final state and step outputs."""

  state: Any
  outputs: list


def run_training(strategy, step_fn: Callable, state: Any, batches: Iterable,
                 *, scalar_reduce=ReduceOp.SUM) -> Trajectory:
  """Trains `step_fn(state, batch) -> (state, outputs)` on `strategy`.

  Per-example outputs are gathered over replicas and per-replica scalars
  reduced with `scalar_reduce`, to compare across device counts.
  """
  step = strategy.function(step_fn)
  state = strategy.replicate(state)
  outputs = []
  for batch in strategy.experimental_distribute_dataset(batches):
    state, out = step(state, batch)
    outputs.append(_comparable(strategy, out, scalar_reduce))
  return Trajectory(placement.to_host(read_value(state)), outputs)


def _comparable(strategy, out, scalar_reduce):
  def one(node):
    kind = kinds.kind_of(node)
    if kind is kinds.PER_REPLICA:
      rank = np.ndim(jax.tree.leaves(kind.payload(node))[0]) - 1
      if rank == 0:
        return strategy.reduce(scalar_reduce, node)
      return strategy.gather(node, axis=0)
    return node
  out = jax.tree.map(one, out, is_leaf=kinds.is_node)
  return placement.to_host(out)


def compare_trees(expected, actual, *, rtol: float, atol: float,
                  names=("expected", "actual"), prefix: str = "") -> list:
  """Lists readable differences between two pytrees of arrays."""
  problems = []
  e_leaves, e_tree = jax.tree_util.tree_flatten_with_path(expected)
  a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual)
  if e_tree != a_tree:
    return [f"{prefix}: structures differ:\n  {names[0]}: {e_tree}\n"
            f"  {names[1]}: {a_tree}"]
  for (path, e), (_, a) in zip(e_leaves, a_leaves):
    where = f"{prefix}{jax.tree_util.keystr(path)}"
    e, a = np.asarray(e), np.asarray(a)
    if e.shape != a.shape:
      problems.append(f"{where}: shape {e.shape} ({names[0]}) vs {a.shape} "
                      f"({names[1]})")
      continue
    if e.dtype.kind in "fc":
      bad = ~np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    else:
      bad = a != e
    if bad.any():
      err = np.abs(a.astype(np.float64) - e.astype(np.float64))
      idx = np.unravel_index(int(np.argmax(np.where(bad, err, -1))), e.shape)
      problems.append(
          f"{where}: {int(bad.sum())} of {e.size} values differ; worst at "
          f"{tuple(int(i) for i in idx)}: {names[0]} {e[idx]!r} vs {names[1]} "
          f"{a[idx]!r} (|diff| {err[idx]:.3g}, rtol {rtol:g}, atol {atol:g})")
  return problems


def devices_hint(n: int) -> str:
  """What to do when a test or a diagnosis needs `n` local devices."""
  return (f"Only {len(jax.local_devices())} local devices; {n} are needed. On a "
          f"CPU, start Python with XLA_FLAGS=--xla_force_host_platform_device_count"
          f"={n} (or call jdist.testing.fake_cpu_devices({n}) before JAX starts).")


def assert_equivalent(step_fn: Callable, state: Any, batches: Iterable,
                      num_replicas: int | None = None, *, strategy=None,
                      reference=None, rtol: float = 1e-4, atol: float = 1e-5,
                      scalar_reduce=ReduceOp.SUM) -> Trajectory:
  """Checks that training on N replicas matches training on one device.

  Compares the final state and every step's outputs.

  Args:
    step_fn: the per-replica step, `(state, batch) -> (state, outputs)`.
    state: the initial state (not yet replicated).
    batches: a re-iterable of global batches (a list, for example).
    num_replicas: replicas of the `MirroredStrategy` under test (default:
      every local device).
    strategy: the strategy under test, instead of `num_replicas`.
    reference: the reference strategy; default one device.
    rtol, atol: float tolerance (reduction order differs between runs).
    scalar_reduce: how per-replica scalars combine (SUM for scaled losses).

  Returns:
    The `Trajectory` of the strategy under test.

  Raises:
    AssertionError: with one line per differing leaf.

  Example:
    >>> import jdist, jdist.testing, jax, jax.numpy as jnp, numpy as np
    >>> def step(w, batch):
    ...   loss_fn = lambda w: jdist.compute_average_loss((batch @ w) ** 2)
    ...   loss, g = jax.value_and_grad(loss_fn)(w)
    ...   return w - 0.1 * g, loss
    >>> data = [np.ones((4, 2), np.float32)] * 3
    >>> _ = jdist.testing.assert_equivalent(step, jnp.ones(2), data, 1)
  """
  batches = list(batches)
  if strategy is None:
    n = num_replicas or len(jax.local_devices())
    if n > len(jax.local_devices()):
      raise ValueError(devices_hint(n))
    strategy = MirroredStrategy(jax.local_devices()[:n])
  reference = reference or OneDeviceStrategy(jax.local_devices()[0])
  expected = run_training(reference, step_fn, state, batches,
                          scalar_reduce=scalar_reduce)
  actual = run_training(strategy, step_fn, state, batches,
                        scalar_reduce=scalar_reduce)
  names = (f"{reference.num_replicas_in_sync}-replica",
           f"{strategy.num_replicas_in_sync}-replica")
  problems = compare_trees(expected.state, actual.state, rtol=rtol, atol=atol,
                           names=names, prefix="state")
  if len(expected.outputs) != len(actual.outputs):
    problems.append(f"steps run: {len(expected.outputs)} vs "
                    f"{len(actual.outputs)}")
  for i, (e, a) in enumerate(zip(expected.outputs, actual.outputs)):
    problems += compare_trees(e, a, rtol=rtol, atol=atol, names=names,
                              prefix=f"step {i} outputs")
  if problems:
    shown = problems[:20]
    more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
    hint = _scaling_hint(placement.to_host(read_value(state)), expected,
                         actual, reference.num_replicas_in_sync,
                         strategy.num_replicas_in_sync)
    raise AssertionError(
        f"{strategy!r} does not reproduce {reference!r}:\n" +
        "\n".join(shown) + more + hint)
  return actual


def _scale(expected: list, actual: list) -> float | None:
  """The least-squares factor `actual ~ factor * expected`, or None."""
  e = np.concatenate([np.ravel(x).astype(np.float64) for x in expected]
                     or [np.zeros(0)])
  a = np.concatenate([np.ravel(x).astype(np.float64) for x in actual]
                     or [np.zeros(0)])
  ok = np.isfinite(e) & np.isfinite(a)
  e, a = e[ok], a[ok]
  norm = float(np.dot(e, e))
  if not e.size or norm == 0.0:
    return None
  return float(np.dot(a, e)) / norm


def _floats(tree) -> list:
  return [np.asarray(x) for x in jax.tree.leaves(tree)
          if np.asarray(x).dtype.kind == "f"]


def _scaling_hint(initial, expected: Trajectory, actual: Trajectory,
                  n_reference: int, n_actual: int) -> str:
  """A line naming loss scaling when runs differ by the replica ratio."""
  n = n_actual / n_reference
  if n == 1:
    return ""
  init, e_state, a_state = (_floats(t) for t in
                            (initial, expected.state, actual.state))
  factors = []
  if len(init) == len(e_state) == len(a_state):
    factors.append(_scale([e - i for e, i in zip(e_state, init)],
                          [a - i for a, i in zip(a_state, init)]))
  factors.append(_scale(_floats(expected.outputs), _floats(actual.outputs)))
  near = [f for f in factors if f is not None and abs(f / n - 1) < 0.15]
  if not near:
    return ""
  return (f"\nLoss scaling? The {n_actual}-replica run moved the parameters "
          f"(or returned outputs) about {near[0]:.3g} times as large as the "
          f"{n_reference}-replica run, close to the ratio of replicas: the loss "
          "looks averaged over each replica's batch, and gradients summed "
          "over the replicas then grow with their number. Divide by the "
          "global batch: jdist.compute_average_loss(per_example_loss).")


def fake_cpu_devices(n: int) -> None:
  """Asks for `n` CPU devices; call before JAX creates its backend.

  Raises:
    RuntimeError: the backend already started with fewer devices.
  """
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError as e:
    if len(jax.devices("cpu")) < n:
      raise RuntimeError(
          f"JAX already started with {len(jax.devices('cpu'))} CPU devices; "
          f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
          "importing jax.") from e
