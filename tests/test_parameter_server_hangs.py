"""Parameter servers and workers that hang (stop answering, without dying),
threads backend.

The tutorial's program (per-worker datasets, `schedule(step_fn)`, `join()`)
meets a server stuck in a call and a worker stuck inside a function. Neither
may hang the coordinator: a server that does not answer within
`timeout_seconds` is a `jdist.ParameterServerError` within that time, and a
worker whose function runs past it is lost, its function run again on
another worker (at least once) and the loss logged. The Ray backend's
version (a SIGSTOPped actor process) is in tests/test_parameter_server_ray.py.

Time bounds are generous on purpose (this machine's 2 cores are shared):
they only tell "within the timeout" from "a multiple of it" or "never".
"""

import logging
import re
import threading
import time

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist._src.ps import server as server_lib
from jdist.examples.models import MLP
from jdist.examples.steps import classifier_step

TIMEOUT = 3.0
# Slack on top of the timeout for threads to wake and the step in flight to
# end on a loaded machine (measured: about 0.1 s); a wait of twice the
# timeout, the failure being fixed, would exceed it.
SLACK = 1.0
MODEL = MLP(hidden=16)
apply_fn = lambda p, x: MODEL.apply({"params": p}, x)
BUILT = []  # the workers whose per-worker dataset was built, in order


def tutorial_program(digits_flat, **kwargs):
  """The TF tutorial's pieces: coordinator, state, per-worker data, step."""
  x, y = digits_flat
  BUILT.clear()
  strategy = jdist.ParameterServerStrategy(
      jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1),
      timeout_seconds=TIMEOUT, **kwargs)
  tx = optax.sgd(0.1)
  train_step = strategy.function(classifier_step(apply_fn, tx))
  coordinator = jdist.ClusterCoordinator(strategy)
  params = MODEL.init(jax.random.key(0), x[:1])["params"]
  state = strategy.replicate((params, tx.init(params)))

  def dataset_fn(ctx):
    BUILT.append(ctx.input_pipeline_id)
    rng = np.random.default_rng(ctx.input_pipeline_id)
    while True:
      i = rng.choice(len(x), 32, replace=False)
      yield {"x": x[i], "y": y[i]}

  iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
  return strategy, coordinator, state, iterator, train_step


def warm_up(coordinator, fn, iterator, built):
  """Runs steps until both workers have built their dataset and compiled the
  step: a first step takes seconds, which under threads counts against the
  timeout."""
  while len(set(built)) < 2:
    coordinator.fetch([coordinator.schedule(fn, args=(iterator,))
                       for _ in range(4)])


@pytest.fixture
def no_thread_left():
  before = set(threading.enumerate())
  yield
  deadline = time.monotonic() + 5
  while time.monotonic() < deadline:
    left = [t for t in threading.enumerate()
            if t not in before and t.is_alive()]
    if not left:
      return
    time.sleep(0.05)
  raise AssertionError(f"threads left behind: {left}")


def test_a_hung_server_is_an_error_within_the_timeout(digits_flat, monkeypatch,
                                                      no_thread_left):
  # The server's thread blocks inside an update (as a server stuck on a lock
  # or a full disk would) until the test lets it go.
  stuck, release = threading.Event(), threading.Event()
  push = server_lib.ParameterServer.push

  def push_or_hang(self, *args):
    if stuck.is_set():
      release.wait(60)
    return push(self, *args)

  monkeypatch.setattr(server_lib.ParameterServer, "push", push_or_hang)
  strategy, coordinator, state, iterator, train_step = tutorial_program(
      digits_flat)

  def step_fn(iterator):
    _, loss = train_step(state, next(iterator))
    return strategy.reduce("sum", loss)

  try:
    warm_up(coordinator, step_fn, iterator, BUILT)
    stuck.set()
    hung_at = time.monotonic()
    for _ in range(10):
      coordinator.schedule(step_fn, args=(iterator,))
    with pytest.raises(jdist.ParameterServerError,
                       match=r"Parameter server 0 \(.*\) did not answer within "
                             r"timeout_seconds=3"):
      coordinator.join()
    took = time.monotonic() - hung_at
    assert took < TIMEOUT + SLACK, took
    # From then on every call says so at once, and a read says so in time.
    with pytest.raises(jdist.ParameterServerError):
      coordinator.schedule(step_fn, args=(iterator,))
    with pytest.raises(jdist.ParameterServerError):
      coordinator.join()
    started = time.monotonic()
    with pytest.raises(jdist.ParameterServerError, match="did not answer"):
      state.read(wait=False)
    assert time.monotonic() - started < TIMEOUT + SLACK
  finally:
    release.set()
    coordinator.shutdown()


def test_a_hung_worker_is_lost_and_its_function_runs_elsewhere(
    digits_flat, caplog, no_thread_left):
  strategy, coordinator, state, iterator, train_step = tutorial_program(
      digits_flat)
  hang_next, lock = threading.Event(), threading.Lock()
  hangs, release, returned = [], threading.Event(), threading.Event()

  def step_fn(iterator):
    batch = next(iterator)
    with lock:  # the next function to start sleeps for a minute
      mine = hang_next.is_set()  # (the test ends the sleep)
      hang_next.clear()
    if mine:
      hangs.append(time.monotonic())
      release.wait(60)
      returned.set()
    _, loss = train_step(state, batch)
    return strategy.reduce("sum", loss)

  try:
    warm_up(coordinator, step_fn, iterator, BUILT)
    before, built = state.version()[0], len(BUILT)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jdist"):
      hang_next.set()
      results = [coordinator.schedule(step_fn, args=(iterator,))
                 for _ in range(20)]
      coordinator.join()
    took = time.monotonic() - hangs[0]
    # Lost after TIMEOUT, then the other worker runs the function again.
    assert took < TIMEOUT * 1.5 + SLACK, took
    assert all(np.isfinite(coordinator.fetch(results)))  # every one ran
    assert state.version()[0] == before + 20  # the hung call has not pushed
    lost = [r for r in caplog.records if r.name.startswith("jdist")]
    assert len(lost) == 1, [r.getMessage() for r in lost]
    message = lost[0].getMessage()
    assert lost[0].levelno == logging.WARNING
    assert re.match(r"Worker [01] failed \(Worker [01] did not finish a "
                    r"scheduled function within timeout_seconds=3", message)
    assert "; 1 scheduled function(s) it had run again" in message
    # The restarted worker runs functions again, its dataset built anew.
    deadline = time.monotonic() + 60
    while len(BUILT) == built and time.monotonic() < deadline:
      more = [coordinator.schedule(step_fn, args=(iterator,))
              for _ in range(4)]
      assert all(np.isfinite(coordinator.fetch(more)))
    assert BUILT[built:] == [int(message.split()[1])]
  finally:
    release.set()
    assert returned.wait(30)
    coordinator.shutdown()
