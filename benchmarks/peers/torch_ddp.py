"""PyTorch worker: `DistributedDataParallel` on CPU with gloo, one process per replica.

Started N times by peers.py with RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and
MASTER_PORT set (as torchrun would), one intra-op thread per process. Each
rank keeps its slice of every global batch as ready tensors (the fastest input
path: no DataLoader), and runs the usual loop: zero_grad, forward,
`F.cross_entropy` (mean over the local batch; DDP averages gradients over
ranks, so the update is the global-mean gradient), backward, `SGD.step`.
Rank 0 answers the orchestrator; every rank reads its commands.
"""

from __future__ import annotations

import datetime
import os
import time

import common


def make_net(name: str):
  import numpy as np
  import torch
  from torch import nn
  params = common.init_params(name)

  def linear(p):
    layer = nn.Linear(*p["kernel"].shape)
    layer.weight.data = torch.from_numpy(np.ascontiguousarray(p["kernel"].T))
    layer.bias.data = torch.from_numpy(p["bias"].copy())
    return layer

  if name == "mlp":
    return nn.Sequential(linear(params["Dense_0"]), nn.ReLU(),
                         linear(params["Dense_1"]))

  def conv(p):
    k = p["kernel"]  # HWIO -> OIHW
    layer = nn.Conv2d(k.shape[2], k.shape[3], 3, padding=1)
    layer.weight.data = torch.from_numpy(np.ascontiguousarray(k.transpose(3, 2, 0, 1)))
    layer.bias.data = torch.from_numpy(p["bias"].copy())
    return layer

  # flax flattens NHWC row-major; torch flattens NCHW: permute the first dense
  # layer's inputs once here instead of the activations at every step.
  d0 = dict(params["Dense_0"])
  k = d0["kernel"]
  d0["kernel"] = (k.reshape(28, 28, 64, k.shape[1]).transpose(2, 0, 1, 3)
                  .reshape(k.shape))
  return nn.Sequential(conv(params["Conv_0"]), nn.ReLU(),
                       conv(params["Conv_1"]), nn.ReLU(), nn.Flatten(),
                       linear(d0), nn.ReLU(), linear(params["Dense_1"]))


def local_batches(name: str, rank: int, world: int):
  """This rank's slice of every global batch, as torch tensors (NCHW images)."""
  import numpy as np
  import torch
  x, y = common.data(name)
  if x.ndim == 5:
    x = x.transpose(0, 1, 4, 2, 3)
  b = x.shape[1] // world
  xs = [torch.from_numpy(np.ascontiguousarray(x[i, rank * b:(rank + 1) * b]))
        for i in range(len(x))]
  ys = [torch.from_numpy(y[i, rank * b:(rank + 1) * b].astype(np.int64))
        for i in range(len(y))]
  full = (torch.from_numpy(np.ascontiguousarray(x[0])),
          torch.from_numpy(y[0].astype(np.int64)))
  return xs, ys, full


class Trainer:

  def __init__(self, name: str, rank: int, world: int, wrap=None):
    import torch
    from torch.nn.parallel import DistributedDataParallel
    self.net = make_net(name)
    self.optimizer = torch.optim.SGD(self.net.parameters(), lr=common.MODELS[name]["lr"])
    if wrap is None:
      self.model = DistributedDataParallel(self.net)
      self.backward = lambda loss: loss.backward()
    else:  # accelerate
      self.model, self.optimizer = wrap.prepare(self.net, self.optimizer)
      self.backward = wrap.backward
    self.xs, self.ys, self.full = local_batches(name, rank, world)
    self.position = 0

  def run(self, steps: int) -> float:
    import torch.distributed as dist
    import torch.nn.functional as F
    dist.barrier()
    start = time.perf_counter()
    for i in common.batch_indices(self.position, steps):
      self.optimizer.zero_grad(set_to_none=True)
      loss = F.cross_entropy(self.model(self.xs[i]), self.ys[i])
      self.backward(loss)
      self.optimizer.step()
    dist.barrier()
    self.position += steps
    return time.perf_counter() - start

  def evaluate(self) -> float:
    import torch
    with torch.no_grad():
      logits = self.net(self.full[0])
    return common.cross_entropy(logits.numpy(), self.full[1].numpy())


def setup():
  import torch
  torch.set_num_threads(1)
  rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
  return rank, world


def main(argv=None):
  args = common.parse_args(argv)
  rank, world = setup()
  assert world == args.replicas, (world, args.replicas)
  proto = common.Protocol(enabled=rank == 0)
  import torch
  import torch.distributed as dist
  dist.init_process_group("gloo", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=120))
  try:
    trainers = {m: Trainer(m, rank, world) for m in args.models}
    loss0 = {m: t.evaluate() for m, t in trainers.items()}
    common.warm_all(trainers, args.warmup)
    common.serve(trainers, proto=proto, info={
        "loss0": loss0, "version": f"torch {torch.__version__}",
        "path": f"DDP, gloo, {world} process(es) x {torch.get_num_threads()} thread"})
  finally:
    dist.destroy_process_group()


if __name__ == "__main__":
  main()
