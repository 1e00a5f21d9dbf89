"""HF Accelerate worker: `Accelerator(cpu=True)` over N processes (gloo on CPU).

Started like torch_ddp.py (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, one
thread per process); Accelerate reads that environment, initialises the gloo
process group itself, and `accelerator.prepare(model, optimizer)` wraps the
model in DDP. The loop is torch_ddp.py's with `accelerator.backward(loss)`;
the same ready per-rank tensors are fed (Accelerate's prepared DataLoader
would only add per-batch cost).
"""

from __future__ import annotations

import common
import torch_ddp


def main(argv=None):
  args = common.parse_args(argv)
  rank, world = torch_ddp.setup()
  proto = common.Protocol(enabled=rank == 0)
  import accelerate
  import torch
  accelerator = accelerate.Accelerator(cpu=True)
  assert accelerator.num_processes == world == args.replicas, (
      accelerator.num_processes, world, args.replicas)
  try:
    trainers = {m: torch_ddp.Trainer(m, rank, world, wrap=accelerator)
                for m in args.models}
    loss0 = {m: t.evaluate() for m, t in trainers.items()}
    common.warm_all(trainers, args.warmup)
    common.serve(trainers, proto=proto, info={
        "loss0": loss0,
        "version": f"accelerate {accelerate.__version__} (torch {torch.__version__})",
        "path": f"Accelerator(cpu=True), {accelerator.distributed_type.value}, "
                f"{world} process(es) x {torch.get_num_threads()} thread"})
  finally:
    accelerator.end_training()


if __name__ == "__main__":
  main()
