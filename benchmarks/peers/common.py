"""What every peer worker shares: the models' shapes, data, initial weights, protocol.

Each framework trains the same two models from the same initial weights on the
same synthetic batches, so the loss after N steps must agree across frameworks
(up to float reduction order). Only numpy is imported here: every worker, in
whichever venv, can use it.

Weights are kept in flax's layout (conv kernels HWIO, dense kernels (in, out),
NHWC images flattened row-major); each worker converts to its own layout.

A worker is a long-lived process: it builds both models, compiles and warms
them up, prints `{"ready": ...}` and then obeys one JSON command per stdin line:
  {"op": "run", "model": "mlp", "steps": 1000}  -> {"seconds": ...}
  {"op": "eval", "model": "mlp"}                -> {"loss": ...}
  {"op": "quit"}
Replies go to the original stdout; anything the framework prints is sent to
stderr, so it cannot corrupt the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

NUM_BATCHES = 4      # distinct global batches, cycled in order
CLASSES = 10

# Model name -> global batch, input shape, SGD learning rate.
MODELS = {
    "mlp": {"batch": 256, "shape": (10,), "lr": 0.05},
    "cnn": {"batch": 64, "shape": (28, 28, 1), "lr": 0.01},
}


def data(model: str) -> tuple[np.ndarray, np.ndarray]:
  """`NUM_BATCHES` global batches: x (K, B, *shape) float32, y (K, B) int32.

  Labels come from a fixed random linear teacher, so the loss can fall.
  """
  spec = MODELS[model]
  rng = np.random.default_rng(1234)
  shape = (NUM_BATCHES, spec["batch"]) + spec["shape"]
  x = rng.standard_normal(shape).astype(np.float32)
  flat = x.reshape(NUM_BATCHES * spec["batch"], -1)
  teacher = rng.standard_normal((flat.shape[1], CLASSES)).astype(np.float32)
  y = np.argmax(flat @ teacher, axis=1).astype(np.int32)
  return x, y.reshape(NUM_BATCHES, spec["batch"])


def init_params(model: str) -> dict:
  """Initial weights in flax's naming and layout (LeCun normal, zero biases)."""
  rng = np.random.default_rng(42)
  def dense(fan_in, fan_out):
    return {"kernel": (rng.standard_normal((fan_in, fan_out)) /
                       np.sqrt(fan_in)).astype(np.float32),
            "bias": np.zeros((fan_out,), np.float32)}
  def conv(cin, cout):
    return {"kernel": (rng.standard_normal((3, 3, cin, cout)) /
                       np.sqrt(9 * cin)).astype(np.float32),
            "bias": np.zeros((cout,), np.float32)}
  if model == "mlp":
    return {"Dense_0": dense(10, 16), "Dense_1": dense(16, CLASSES)}
  return {"Conv_0": conv(1, 32), "Conv_1": conv(32, 64),
          "Dense_0": dense(28 * 28 * 64, 64), "Dense_1": dense(64, CLASSES)}


def batch_indices(start: int, steps: int) -> list[int]:
  """Which of the `NUM_BATCHES` batches steps start .. start+steps-1 use."""
  return [(start + i) % NUM_BATCHES for i in range(steps)]


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> float:
  """Mean softmax cross-entropy, in float64 numpy (for evaluation)."""
  logits = logits.astype(np.float64)
  logits = logits - logits.max(axis=1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
  return float(-logp[np.arange(len(y)), y].mean())


def local_devices(n: int) -> list:
  """This process's first `n` JAX devices, or an exit that says how to get
  them (JAX is imported here: the torch peers never call this)."""
  import jax
  devices = jax.local_devices()[:n]
  if len(devices) < n:
    raise SystemExit(f"need {n} devices, have {len(jax.local_devices())}: set "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=N")
  return devices


def pop_option(argv: list, flag: str, default):
  """Removes `flag VALUE` from `argv` (a worker's own option); its value,
  converted like `default`, or `default`."""
  if flag not in argv:
    return default
  i = argv.index(flag)
  value = argv.pop(i + 1)
  argv.pop(i)
  return type(default)(value)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  parser.add_argument("--replicas", type=int, required=True)
  parser.add_argument("--models", default="mlp,cnn")
  parser.add_argument("--warmup", default="mlp:100,cnn:4",
                      help="warm-up steps per model, e.g. mlp:100,cnn:4")
  args = parser.parse_args(argv)
  args.models = [m for m in args.models.split(",") if m]
  args.warmup = {k: int(v) for k, v in
                 (kv.split(":") for kv in args.warmup.split(",") if kv)}
  return args


class Protocol:
  """JSON lines on the process's original stdout; fd 1 then points at stderr."""

  def __init__(self, enabled: bool = True):
    self.enabled = enabled
    if enabled:
      sys.stdout.flush()
      self._out = os.fdopen(os.dup(1), "w", buffering=1)
      os.dup2(2, 1)

  def send(self, **msg) -> None:
    if self.enabled:
      self._out.write(json.dumps(msg) + "\n")
      self._out.flush()


def serve(trainers: dict, *, proto: Protocol, info: dict | None = None) -> None:
  """Answers commands until "quit" or end of input.

  Args:
    trainers: model name -> object with `run(steps) -> seconds` and
      `evaluate() -> loss`; `run` trains from where the last call stopped and
      returns the wall time of the steps (synchronised at both ends).
    proto: where replies go (`Protocol(enabled=False)` for ranks > 0).
    info: extra fields for the ready message (versions, the path taken).
  """
  proto.send(ready=True, **(info or {}))
  for line in sys.stdin:
    if not line.strip():
      continue
    cmd = json.loads(line)
    op = cmd["op"]
    try:
      if op == "quit":
        break
      trainer = trainers[cmd["model"]]
      if op == "run":
        proto.send(seconds=trainer.run(int(cmd["steps"])))
      elif op == "eval":
        proto.send(loss=trainer.evaluate())
      else:
        proto.send(error=f"unknown op {op!r}")
    except Exception:  # reported to the orchestrator, which gives up on this peer
      proto.send(error=traceback.format_exc()[-2000:])
      raise


def warm_all(trainers: dict, warmup: dict) -> None:
  for name, trainer in trainers.items():
    trainer.run(warmup.get(name, 1))


def timed(fn):
  """Wall time of `fn()`, which must return only once its work is done."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start
