"""MultiWorkerMirroredStrategy, TPUStrategy and their options, in one process.

Real multi-process runs are in tests/multiprocess/.
"""

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
import jdist.testing
from jdist._src.input import agreement
from jdist.examples.data import batches
from jdist.examples.models import MLP
from test_conformance import classifier_step, make_state


def test_without_a_cluster_it_spans_the_local_devices():
  strategy = jdist.MultiWorkerMirroredStrategy()
  assert strategy.num_replicas_in_sync == len(jax.devices()) == 4
  assert strategy.cluster_config is None and strategy.cluster_resolver is None
  assert strategy.communication_options == jdist.CommunicationOptions()
  step = strategy.function(lambda x: x * jdist.get_replica_context()
                           .replica_id_in_sync_group)
  batch = next(iter(strategy.experimental_distribute_dataset([np.ones((8, 1))])))
  assert float(strategy.reduce("sum", step(batch), axis=0).sum()) == 12.0


def test_communication_options():
  opts = jdist.CommunicationOptions(timeout_seconds=2.5)
  strategy = jdist.MultiWorkerMirroredStrategy(communication_options=opts)
  assert strategy.communication_options.timeout_seconds == 2.5
  TFOptions = collections.namedtuple("CommunicationOptions",
                                     "bytes_per_pack timeout_seconds")
  assert jdist.CommunicationOptions.of(TFOptions(0, 7)).timeout_seconds == 7
  for bad in (0, -1, True, "10"):
    with pytest.raises(ValueError, match="timeout_seconds must be a positive"):
      jdist.CommunicationOptions(timeout_seconds=bad)
  with pytest.raises(TypeError, match="must be jdist.CommunicationOptions"):
    jdist.MultiWorkerMirroredStrategy(communication_options={"timeout": 1})


def test_a_wrong_resolver_is_refused():
  with pytest.raises(TypeError, match="jdist.cluster_resolver resolver"):
    jdist.MultiWorkerMirroredStrategy(cluster_resolver="grpc://host:1")


def test_tpu_strategy_without_a_tpu_says_what_to_use():
  with pytest.raises(jdist.ClusterError, match=r"TPUStrategy needs TPU devices, but "
                     r"JAX sees only cpu devices.*MirroredStrategy"):
    jdist.TPUStrategy()


def test_tpu_strategy_runs_the_shared_engine(monkeypatch, digits_flat):
  """With TPU discovery pointed at the CPUs, TPUStrategy trains like the rest."""
  monkeypatch.setattr("jdist._src.strategies.tpu.tpu_devices",
                      lambda: tuple(jax.local_devices()))
  strategy = jdist.TPUStrategy()
  assert strategy.num_replicas_in_sync == 4
  assert type(strategy).__mro__[1] is jdist.Strategy
  x, y = digits_flat
  data = batches(x[:256], y[:256], 64)
  jdist.testing.assert_equivalent(classifier_step, make_state(MLP(), data[0]["x"]),
                                  data, strategy=strategy)


# --- keeping per-process inputs in step (one simulated peer) ------------------


class FakeRuntime:
  """Process 0 of two, whose peer (process 1) publishes `windows`."""

  process_id = 0

  def __init__(self, windows):
    self.windows = list(windows)
    self.calls = 0

  def exchange(self, prefix, value, *, timeout, what):
    del prefix, timeout, what
    self.calls += 1
    return {0: value, 1: json.dumps(self.windows.pop(0))}

  def delete(self, key):
    del key


def host_steps(sizes, b=4):
  """Host steps of one process with 2 replicas: (rows, valid, local count)."""
  out = []
  for n in sizes:
    valid = np.arange(2 * b).reshape(2, b) < n
    out.append(({"x": np.ones((2, b, 3), np.float32)}, valid, n))
  return iter(out)


def agree(mine, peer_windows, *, per_process=True, window=4):
  peer = FakeRuntime(peer_windows)
  source = host_steps(mine)
  steps_agreed = agreement.StepAgreement(
      lambda: next(source, None), runtime=peer, key="test", window=window,
      per_process=per_process, timeout=None)
  steps = []
  while (item := steps_agreed.next()) is not None:
    steps.append(item)
  return steps, peer


SPEC = "{'x': 'float32[4, 3]'}"


def test_a_process_whose_data_ends_first_feeds_padding():
  # This process has 2 steps, its peer 5 (windows of 4): 5 steps for both.
  peer = [{"n": 4, "counts": [8, 8, 8, 8], "spec": SPEC},
          {"n": 1, "counts": [3], "spec": SPEC}]
  steps, fake = agree([8, 5], peer)
  assert len(steps) == 5 and fake.calls == 2
  assert [c for _, _, c in steps] == [16, 13, 8, 8, 3]  # global valid counts
  for rows, valid, _ in steps[2:]:
    assert not valid.any() and not rows["x"].any() and rows["x"].shape == (2, 4, 3)


def test_exchanges_once_per_window():
  peer = [{"n": 4, "counts": [8] * 4, "spec": SPEC}] * 2 + [
      {"n": 0, "counts": [], "spec": SPEC}]
  steps, fake = agree([8] * 8, peer)
  assert len(steps) == 8 and fake.calls == 3


def test_global_batches_of_different_lengths_raise():
  peer = [{"n": 3, "counts": [8, 8, 8], "spec": SPEC}]
  with pytest.raises(jdist.DistributionError, match=r"different lengths.*"
                     r"process 0: 4, process 1: 3.*distribute_datasets_from_function"):
    agree([8] * 6, peer, per_process=False)


def test_processes_must_batch_alike():
  peer = [{"n": 1, "counts": [8], "spec": "{'x': 'float32[4, 5]'}"}]
  with pytest.raises(jdist.DistributionError, match=r"differ in structure.*"
                     r"process 0: \{'x': 'float32\[4, 3\]'\}"):
    agree([8], peer)


def test_a_process_without_any_data_is_told_to_shard_better():
  peer = [{"n": 2, "counts": [8, 8], "spec": SPEC}]
  with pytest.raises(jdist.DistributionError, match=r"no batches while another's "
                     r"has 2.*at least one batch"):
    agree([], peer)


def test_per_process_input_trains_like_one_device(digits_flat):
  """distribute_datasets_from_function on one process (no agreement needed):
  each step takes one per-replica batch for each of the 4 replicas, in order,
  so the run is one device's over global batches of 64 (the last one 8
  examples on replica 0, nothing on the others)."""
  strategy = jdist.MultiWorkerMirroredStrategy()
  x, y = digits_flat
  step = strategy.function(classifier_step)
  initial = make_state(MLP(), x[:16])
  state = strategy.replicate(initial)
  seen, losses = 0, []
  for batch in strategy.distribute_datasets_from_function(
      lambda ctx: batches(x[:200], y[:200], ctx.get_per_replica_batch_size(64))):
    state, out = step(state, batch)
    seen += int(jnp.sum(batch.mask))
    losses.append(float(strategy.reduce("sum", out["loss"])))
  assert seen == 200
  one = jdist.testing.run_training(jdist.OneDeviceStrategy(), classifier_step,
                                   initial, batches(x[:200], y[:200], 64))
  np.testing.assert_allclose(losses, [o["loss"] for o in one.outputs],
                             rtol=1e-5)
  got = jax.device_get(jdist.read_value(state))
  problems = jdist.testing.compare_trees(
      (one.state.params, one.state.opt_state), (got.params, got.opt_state),
      rtol=1e-4, atol=1e-5, names=("1 device", "4 replicas"))
  assert not problems, "\n".join(problems)
