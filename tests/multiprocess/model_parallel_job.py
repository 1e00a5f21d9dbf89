"""One process of the many-hosts model-parallel test:
`jdist launch -n 2 --devices-per-process 2 model_parallel_job.py OUT`.

Trains the MLP of model_parallel_train.py on a 2x2 data x model mesh
twice: laid out by jdist (`DeviceMesh` without devices: the data axis across
the processes, the model axis inside each) and laid out by hand the other
way round (the model axis across the processes); then a pipeline whose
stages are the two processes (model_parallel_train.py). Each process writes what
it holds: for every parameter and momentum array, its addressable shards
(device, index, data), to OUT/<layout>-<process>.pkl. Nothing is gathered:
the test rebuilds the arrays from the two processes' shards.
"""

import os
import pickle
import sys

import jax
import numpy as np

import model_parallel_train as train_lib

OUT = sys.argv[1]


def shards(tree):
  """{path: [(device id, ((start, stop) per dimension), numpy data)]}."""
  out = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out[jax.tree_util.keystr(path)] = [
        (s.device.id, tuple(i.indices(n)[:2] for i, n in zip(s.index, x.shape)),
         np.asarray(s.data)) for s in x.addressable_shards]
  return out


def run(layout, strategy, pipeline=False):
  params, opt_state, losses = train_lib.train(strategy, pipeline)
  record = {"losses": losses, "params": shards(params),
            "momentum": shards(opt_state),
            "mesh": [[d.id for d in row]
                     for row in strategy.device_mesh.devices],
            "local": sorted(d.id for d in jax.local_devices())}
  me = jax.process_index()
  with open(os.path.join(OUT, f"{layout}-{me}.pkl"), "wb") as f:
    pickle.dump(record, f)
  print(f"[{me}] trained {layout}", flush=True)


def main():
  run("auto", train_lib.strategy_2x2())  # the mesh joins the run
  by_hand = np.array(jax.devices(), dtype=object).reshape(2, 2).T
  run("by_hand", train_lib.strategy_2x2(by_hand))
  run("pipeline", train_lib.strategy_pipeline(), pipeline=True)


main()
