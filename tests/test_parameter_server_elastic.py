"""ParameterServerStrategy on Ray: workers that join and leave a running job.

One multi-node Ray cluster on this machine for the module
(`ray.cluster_utils.Cluster`: a head node with 2 CPUs, room for the two
workers the job starts with); a node added mid-run makes room for a third
worker, and removing it (or killing a worker's process) makes a worker
leave. Every scheduled step adds 1 to a counter on the parameter server, so
the counter is the number of updates applied: at least once per scheduled
step, at most once more per step the log says ran again.
"""

import contextlib
import logging
import os
import re
import signal
import threading
import time
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jdist

ray = pytest.importorskip("ray")
from ray_processes import COORDINATORS, actor_pids, wait_gone  # noqa: E402 (needs Ray)
from ray_processes import shut_down_coordinators  # noqa: E402,F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@contextlib.contextmanager
def forking():
  """Ray starts a node's services with fork + exec, which Python flags once
  JAX has threads; nothing runs between the two."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                            category=RuntimeWarning)
    yield


@pytest.fixture(scope="module")
def cluster():
  from ray.cluster_utils import Cluster
  with forking():
    # No idle worker processes started ahead: the workers' own environment
    # (XLA_FLAGS) takes new ones anyway.
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "_system_config": {
            "enable_worker_prestart": False,
            "prestart_worker_first_driver": False}})
    ray.init(address=nodes.address, log_to_driver=False,
             configure_logging=False)
  yield nodes
  ray.shutdown()
  nodes.shutdown()


def worker_pids() -> list:
  return actor_pids("TrainingWorker")


def setup(**ray_options):
  """Two workers, one server; a per-worker dataset; a counting step."""
  strategy = jdist.ParameterServerStrategy(
      jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1),
      backend="ray", timeout_seconds=30, ray_options=ray_options)
  coordinator = jdist.ClusterCoordinator(strategy)
  COORDINATORS.append(coordinator)
  counter = strategy.replicate(jnp.zeros((1,), jnp.float32))
  count = strategy.function(lambda c, batch: (c + 1.0, jnp.sum(c)))

  def dataset_fn(ctx):
    # Which process built this dataset, which call of dataset_fn it is, and
    # the worker's input pipeline.
    build = np.random.default_rng().integers(1, 2**30)
    row = np.array([os.getpid(), build, ctx.input_pipeline_id,
                    ctx.num_input_pipelines], np.int32)
    while True:
      yield np.tile(row, (4, 1))

  iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

  def step_fn(iterator):
    batch = next(iterator)
    count(counter, batch)
    made = strategy.reduce("max", batch, axis=0)
    return tuple(int(v) for v in made) + (os.getpid(),)

  return strategy, coordinator, counter, iterator, step_fn


def run_until(coordinator, step_fn, iterator, predicate, timeout=180.0):
  """Schedules steps, 4 at a time, until `predicate(results)` holds."""
  results = []
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    results += coordinator.fetch([coordinator.schedule(step_fn, args=(iterator,))
                                  for _ in range(4)])
    if predicate(results):
      return results
  raise AssertionError(f"not reached in {timeout} s; {len(results)} steps ran "
                       f"on {sorted({r[-1] for r in results})}")


def reran(records) -> int:
  """How many functions the coordinator's warnings say ran again."""
  return sum(int(m.group(1)) for r in records if (m := re.search(
      r"; (\d+) scheduled function\(s\) it had run again", r.getMessage())))


def test_workers_join_and_leave_mid_run(cluster, caplog):
  strategy, coordinator, counter, iterator, step_fn = setup(
      max_workers=3, worker={"max_restarts": 0})
  scheduled = 0
  first = run_until(coordinator, step_fn, iterator,
                    lambda rs: len({r[-1] for r in rs}) == 2)
  scheduled += len(first)
  assert coordinator.num_workers == 2  # the head node has no room for more
  old = {r[-1] for r in first}
  with caplog.at_level(logging.INFO, logger="jdist"):
    with forking():
      node = cluster.add_node(num_cpus=1)
    joined = time.monotonic()
    grown = run_until(coordinator, step_fn, iterator,
                      lambda rs: {r[-1] for r in rs} - old)
    print(f"a worker ran steps {time.monotonic() - joined:.1f} s after its "
          "node joined")
    scheduled += len(grown)
    (new,) = {r[-1] for r in grown} - old
    assert coordinator.num_workers == 3
    joins = [r for r in caplog.records if "joined" in r.getMessage()]
    assert len(joins) == 1 and joins[0].levelno == logging.INFO
    assert re.fullmatch(
        rf"Worker 2 joined the cluster \(pid {new} on node \w+\); scheduled "
        r"functions run on it, 3 worker\(s\) now\.", joins[0].getMessage())
    on_new = [r for r in grown if r[-1] == new]
    # Its steps take batches of a dataset built on it, once, as pipeline 2
    # of the 3 the input context counts.
    assert {r[0] for r in on_new} == {new}
    assert len({r[1] for r in on_new}) == 1
    assert {(r[2], r[3]) for r in on_new} == {(2, 3)}
    assert {r[3] for r in first} == {3}
    # The node leaves while steps run on every worker.
    results = [coordinator.schedule(step_fn, args=(iterator,))
               for _ in range(300)]
    scheduled += 300
    cluster.remove_node(node)
    coordinator.join()
    done = coordinator.fetch(results)  # every one ran
    # The worker is found gone when it is given a step: the steps above may
    # all have finished before.
    tail = run_until(coordinator, step_fn, iterator,
                     lambda rs: coordinator.num_workers == 2, timeout=60)
    scheduled += len(tail)
    coordinator.join()
  assert len(done) == 300
  lines = [r.getMessage() for r in caplog.records if r.name.startswith("jdist")]
  left = [m for m in lines if m.startswith("Worker 2 left the cluster")]
  assert len(left) == 1, lines
  assert "its node has died" in left[0], left[0]
  assert "dropped from scheduling, 2 worker(s) left" in left[0]
  failed = [r for r in caplog.records if r.getMessage().startswith(
      "Worker 2 failed")]
  assert len(failed) == 1 and failed[0].levelno == logging.WARNING
  # At least once: every step's +1 is applied, a rerun one perhaps twice.
  (total,) = np.asarray(counter.read())
  assert total == counter.version()[0]
  assert scheduled <= total <= scheduled + reran(caplog.records), (
      scheduled, total, lines)
  after = run_until(coordinator, step_fn, iterator, lambda rs: len(rs) >= 8)
  scheduled += len(after)
  assert {r[-1] for r in after} <= old
  assert set(worker_pids()) == old
  # A worker's process is killed mid-run (no restarts left): its steps run on
  # the other worker, the run finishes, and a new worker joins in its place
  # (its CPU on the head node is free again), in its slot.
  rerun = reran(caplog.records)
  victim = min(old)
  (slot,) = {r[2] for r in first if r[-1] == victim}
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="jdist"):
    results = [coordinator.schedule(step_fn, args=(iterator,))
               for _ in range(300)]
    scheduled += 300
    os.kill(victim, signal.SIGKILL)
    coordinator.join()
    assert len(coordinator.fetch(results)) == 300  # every one ran
    replaced = run_until(coordinator, step_fn, iterator,
                         lambda rs: {r[-1] for r in rs} - old)
    scheduled += len(replaced)
  (newcomer,) = {r[-1] for r in replaced} - old
  lines = [r.getMessage() for r in caplog.records if r.name.startswith("jdist")]
  assert [m for m in lines if "left" in m] == [
      f"Worker {slot} left the cluster (its actor died for good: its worker "
      "process has died); it is dropped from scheduling, 1 worker(s) left."
  ], lines
  joins = [m for m in lines if "joined" in m]
  assert len(joins) == 1 and re.fullmatch(
      rf"Worker {slot} joined the cluster \(pid {newcomer} on node \w+\); "
      r"scheduled functions run on it, 2 worker\(s\) now\.", joins[0]), lines
  (total,) = np.asarray(counter.read())
  assert scheduled <= total <= scheduled + rerun + reran(caplog.records), (
      scheduled, total, lines)
  pids = worker_pids()
  assert set(pids) == old - {victim} | {newcomer}
  coordinator.shutdown()
  assert wait_gone(pids) == [] and worker_pids() == []
  assert not [t for t in threading.enumerate() if t.name.startswith("jdist-")]


def test_below_min_workers_is_an_error(cluster, caplog):
  strategy, coordinator, counter, iterator, step_fn = setup(
      min_workers=2, worker={"max_restarts": 0})
  victim = worker_pids()[0]  # the job's workers, started with it
  results = [coordinator.schedule(step_fn, args=(iterator,))
             for _ in range(300)]
  with caplog.at_level(logging.INFO, logger="jdist"):
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(jdist.WorkerFailedError) as info:
      coordinator.join()
  message = str(info.value)
  assert re.match(r"Too few workers are left to go on: worker [01] left the "
                  r"cluster \(its actor died for good", message), message
  assert "leaving 1, fewer than min_workers=2" in message
  # From then on, the error every time.
  with pytest.raises(jdist.WorkerFailedError, match="fewer than min_workers"):
    coordinator.schedule(step_fn, args=(iterator,))
  with pytest.raises(jdist.WorkerFailedError, match="fewer than min_workers"):
    coordinator.join()
  left = [r.getMessage() for r in caplog.records
          if "left the cluster" in r.getMessage()]
  assert len(left) == 1 and "1 worker(s) left" in left[0], left
  # A step either ran (at least once) or did not run and says why.
  ran = 0
  for r in results:
    try:
      r.fetch()
      ran += 1
    except (jdist.WorkerFailedError, jdist.CancelledError):
      pass
  assert ran <= counter.version()[0]
  pids = worker_pids()
  coordinator.shutdown()
  assert wait_gone(pids) == [] and worker_pids() == []


@pytest.mark.parametrize("options, match", [
    ({"max_workers": 1}, r"min_workers <= num_workers <= max_workers.*"
                         r"starts with its 2 worker\(s\).*max_workers=1"),
    ({"min_workers": 3}, r"min_workers=3, max_workers=2"),
    ({"max_workers": 2.5}, r"ray_options\['max_workers'\] must be a positive "
                           r"integer, got 2.5"),
    ({"min_workers": 0}, r"ray_options\['min_workers'\] must be a positive"),
])
def test_scaling_options_are_checked(options, match):
  with pytest.raises(ValueError, match=match):
    jdist.ParameterServerStrategy(
        jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1),
        backend="ray", ray_options=options)


def test_scaling_options_need_ray():
  with pytest.raises(ValueError, match="need backend='ray'"):
    jdist.ParameterServerStrategy(
        jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1),
        ray_options={"max_workers": 4})
