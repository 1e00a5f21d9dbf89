"""The order of the replicas: the physical topology on TPU and GPU.

Fake device objects stand in for TPU chips and GPUs (coords, core_on_chip,
slice_index, as jax's TPU devices have them); the strategies are built by
their public constructors. That a permuted or host-interleaved replica order
still trains exactly is checked here on CPU devices and across two real
processes in tests/multiprocess/.
"""

import dataclasses
import random

import jax
import pytest

import jdist
import jdist.testing
from jdist._src.strategies.devices import replica_order
from jdist.examples.data import batches
from jdist.examples.models import MLP
from test_conformance import classifier_step, make_state


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  platform: str = "tpu"
  device_kind: str = "TPU v3"
  process_index: int = 0
  coords: tuple = (0, 0, 0)
  core_on_chip: int = 0
  slice_index: int = 0


def tpu_v3_8(slice_index=0, first_id=0):
  """A TPU v3-8: 4 chips (2x2), 2 cores each, ids in jax.devices() order."""
  return [FakeDevice(first_id + i, coords=(i // 2 % 2, i // 4, 0),
                     core_on_chip=i % 2, slice_index=slice_index)
          for i in range(8)]


def tpu_v4_pod_2_hosts():
  """A TPU v4 2x2x2 slice: 8 chips, 4 on each of two hosts (z = host)."""
  return [FakeDevice(i, device_kind="TPU v4", coords=(i % 2, i // 2 % 2, i // 4),
                     process_index=i // 4) for i in range(8)]


def shuffled(devices):
  devices = list(devices)
  random.Random(0).shuffle(devices)
  return devices


def ids(strategy):
  return [d.id for d in strategy.devices]


@pytest.fixture
def fake_tpus(monkeypatch):
  def use(devices):
    monkeypatch.setattr("jdist._src.strategies.tpu.tpu_devices",
                        lambda: tuple(devices))
  return use


def test_tpu_strategy_follows_the_ring_of_a_tpu_v3_8(fake_tpus):
  # jax.make_mesh's docstring: on a TPU v3-8 the ring is 0 1 2 3 6 7 4 5.
  fake_tpus(shuffled(tpu_v3_8()))
  assert ids(jdist.TPUStrategy()) == [0, 1, 2, 3, 6, 7, 4, 5]


def test_tpu_pod_order_is_that_of_jax_make_mesh_across_hosts(fake_tpus):
  devices = tpu_v4_pod_2_hosts()
  fake_tpus(shuffled(devices))
  strategy = jdist.TPUStrategy()
  mesh = jax.make_mesh((8,), ("replica",), devices=devices)
  assert strategy.devices == tuple(mesh.devices.flat)
  # The ring alternates between the hosts: not the (process, id) order.
  assert [d.process_index for d in strategy.devices] != sorted(
      d.process_index for d in devices)


def test_multislice_runs_each_slice_in_its_ring_order(fake_tpus):
  fake_tpus(shuffled(tpu_v3_8(slice_index=1, first_id=8) + tpu_v3_8()))
  ring = [0, 1, 2, 3, 6, 7, 4, 5]
  assert ids(jdist.TPUStrategy()) == ring + [8 + i for i in ring]


def test_tpus_without_a_known_layout_keep_the_process_order(fake_tpus):
  # Three chips are no cuboid: mesh_utils has no ring, the order is a speed
  # matter, so the strategy still builds.
  fake_tpus(shuffled(tpu_v4_pod_2_hosts()[:3]))
  assert ids(jdist.TPUStrategy()) == [0, 1, 2]


def test_gpus_follow_xla_global_numbering(monkeypatch):
  # jax.devices() lists GPUs by process; XLA numbers them by topology (here
  # process 0 drives 0, 1, 4, 5). The ring follows the numbering.
  owner = {0: 0, 1: 0, 4: 0, 5: 0, 2: 1, 3: 1, 6: 1, 7: 1}
  gpus = sorted((FakeDevice(i, platform="gpu", device_kind="NVIDIA H100",
                            process_index=p) for i, p in owner.items()),
                key=lambda d: (d.process_index, d.id))
  monkeypatch.setattr(jax, "devices", lambda *a: list(gpus))
  monkeypatch.setattr(jax, "local_devices",
                      lambda *a, **k: [d for d in gpus if d.process_index == 0])
  monkeypatch.setattr("jdist._src.strategies.base.placement.spans_processes",
                      lambda mesh: False)
  assert ids(jdist.MultiWorkerMirroredStrategy()) == list(range(8))
  assert ids(jdist.MirroredStrategy()) == [0, 1, 4, 5]
  # A list of devices is the user's replica order, as in TensorFlow.
  assert ids(jdist.MirroredStrategy(["gpu:3", "/gpu:1"])) == [5, 1]


def test_cpu_devices_are_ordered_by_process_then_id():
  cpus = [FakeDevice(i, platform="cpu", process_index=p)
          for p, i in [(1, 2049), (0, 1), (1, 2048), (0, 0)]]
  assert [d.id for d in replica_order(cpus)] == [0, 1, 2048, 2049]
  assert jdist.MultiWorkerMirroredStrategy().devices == tuple(jax.devices())


def test_a_permuted_replica_order_trains_like_one_device(devices, digits_flat):
  strategy = jdist.MirroredStrategy([devices[2], devices[0], devices[3],
                                     devices[1]])
  x, y = digits_flat
  data = batches(x[:200], y[:200], 64)  # ends with a short, padded batch
  jdist.testing.assert_equivalent(classifier_step,
                                  make_state(MLP(), data[0]["x"]), data,
                                  strategy=strategy)
