"""Peer comparison: the seed MLP and CNN trained by jdist and by its peers.

Every framework trains the same model from the same initial weights on the
same synthetic batches (fixed seed), with SGD and softmax cross-entropy, for
the same number of steps (see benchmarks/peers/common.py). Each framework runs
in its own long-lived worker process (benchmarks/peers/*.py): jdist with this
interpreter (the project's venv), the peers with the peers' venv
(`--peers-python`, by default .venv-peers, which `make bench` builds), so no
peer is ever a dependency of jdist.

For each replica count, all workers start, compile and warm up; then every
round runs one block of steps per framework and model, the frameworks'
order rotating from round to round, so that the machine's noise hits all
alike. Reported: samples/s (median over rounds, with min and max), and the
speed ratio jdist / peer (the median of the per-round ratios, with min and
max); ratios > 1 mean jdist is faster. After the last round every worker
evaluates its model on the first global batch: the losses must agree, which
shows that all trained the same model on the same data.

  python benchmarks/peers.py --quick                 # a smoke run
  python benchmarks/peers.py --frameworks jdist --replicas 1,2 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
WORKERS = HERE / "peers"
REPO = HERE.parent
DEFAULT_PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"


@dataclasses.dataclass(frozen=True)
class Framework:
  label: str
  script: str
  peer: bool = True          # runs in the peers' venv
  multiprocess: bool = False  # one process per replica (torch.distributed)
  args: tuple = ()


FRAMEWORKS = {
    "jdist": Framework("jdist MirroredStrategy", "jdist_mirrored.py", peer=False),
    "jdist_multi": Framework(
        "jdist custom loop, multi_step over 32 batches", "jdist_mirrored.py",
        peer=False, args=("--steps-per-execution", "32")),
    "jdist_fit_spe": Framework(
        "jdist Trainer fit, steps_per_execution=32", "jdist_fit.py",
        peer=False, args=("--steps-per-execution", "32")),
    "jax_hand": Framework("hand-written JAX (reference)", "jax_hand.py", peer=False),
    "keras_jax": Framework("Keras 3 (JAX) DataParallel, fit", "keras_jax.py"),
    "keras_jax_spe": Framework(
        "Keras 3 (JAX) DataParallel, fit, steps_per_execution=32", "keras_jax.py",
        args=("--steps-per-execution", "32")),
    "tf_mirrored": Framework("TF MirroredStrategy", "tf_mirrored.py"),
    # benchmarks/keras_models.py's rows (not in peers.py's default list):
    # a Keras model in jdist's Trainer, the same model in flax through the
    # Trainer, and Keras's own fit on the same JAX and Keras as jdist.
    "jdist_keras": Framework("jdist Trainer fit, Keras model",
                             "jdist_keras.py", peer=False),
    "jdist_fit": Framework("jdist Trainer fit, flax model", "jdist_fit.py",
                           peer=False),
    "keras_jax_here": Framework(
        "Keras 3 (JAX) DataParallel, fit (jdist's environment)",
        "keras_jax.py", peer=False),
    "torch_ddp": Framework("torch DDP (gloo)", "torch_ddp.py", multiprocess=True),
    "accelerate": Framework("HF Accelerate (gloo)", "accelerate_ddp.py",
                            multiprocess=True),
}
KERAS_MODELS_ONLY = ("jdist_keras", "jdist_fit", "keras_jax_here")
DEFAULT_FRAMEWORKS = [f for f in FRAMEWORKS if f not in KERAS_MODELS_ONLY]
MODEL_LABELS = {"mlp": "MLP 10-16-10", "cnn": "CNN 28x28x1"}

# MLP blocks are whole groups of 32 steps, for the steps_per_execution=32 rows.
FULL = {"replicas": "1,2,4", "rounds": 5, "steps": "mlp:512,cnn:10",
        "warmup": "mlp:128,cnn:4"}
QUICK = {"replicas": "2", "rounds": 2, "steps": "mlp:100,cnn:2",
         "warmup": "mlp:10,cnn:2"}

READY_TIMEOUT = 600.0   # import, build, compile, warm up: slow when loaded
BLOCK_TIMEOUT = 300.0   # one block of steps
QUIT_TIMEOUT = 10.0


class WorkerError(RuntimeError):
  pass


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _jax_xla_flags(replicas: int) -> str:
  """XLA_FLAGS for a worker on this environment's JAX: the caller's flags
  (none under `make bench`; the tests' optimization level) with the worker's
  device count. The peers' own venvs get the device count alone."""
  flag = "--xla_force_host_platform_device_count"
  keep = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith(flag)]
  return " ".join(keep + [f"{flag}={replicas}"])


class Worker:
  """One framework's process(es) for one replica count; rank 0 answers."""

  def __init__(self, name: str, fw: Framework, python: str, replicas: int,
               models: list, warmup: str, logdir: pathlib.Path):
    self.name = name
    self.procs = []
    self.logs = []
    self._buf = b""
    argv = [python, str(WORKERS / fw.script), "--replicas", str(replicas),
            "--models", ",".join(models), "--warmup", warmup, *fw.args]
    base = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={replicas}",
                CUDA_VISIBLE_DEVICES="-1", TF_CPP_MIN_LOG_LEVEL="2")
    base.pop("PYTHONPATH", None)
    if not fw.peer:  # jdist from this checkout, even if not installed
      base["PYTHONPATH"] = str(REPO)
      base["XLA_FLAGS"] = _jax_xla_flags(replicas)
    ranks = range(replicas) if fw.multiprocess else range(1)
    if fw.multiprocess:
      base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                  WORLD_SIZE=str(replicas), LOCAL_WORLD_SIZE=str(replicas),
                  OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
      for rank in ranks:
        env = dict(base)
        if fw.multiprocess:
          env.update(RANK=str(rank), LOCAL_RANK=str(rank))
        log = logdir / f"{name}-{replicas}-rank{rank}.log"
        self.logs.append(log)
        with open(log, "wb") as err:
          self.procs.append(subprocess.Popen(
              argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
              env=env, cwd=str(WORKERS), start_new_session=True))
    except BaseException:
      self.close()
      raise

  def send(self, **cmd) -> None:
    line = (json.dumps(cmd) + "\n").encode()
    for p in self.procs:
      try:
        p.stdin.write(line)
        p.stdin.flush()
      except (BrokenPipeError, OSError):
        pass  # reported by recv

  def recv(self, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    out = self.procs[0].stdout
    while b"\n" not in self._buf:
      dead = [p for p in self.procs if p.poll() is not None]
      left = deadline - time.monotonic()
      if dead or left <= 0:
        why = (f"exited with code {dead[0].returncode}" if dead else
               f"no answer within {timeout:.0f} s")
        raise WorkerError(f"{self.name} {why}: {self.stderr_tail()}")
      ready, _, _ = select.select([out], [], [], min(left, 1.0))
      if ready:
        chunk = os.read(out.fileno(), 65536)
        if not chunk and self.procs[0].poll() is None:
          time.sleep(0.1)
        self._buf += chunk
    line, self._buf = self._buf.split(b"\n", 1)
    msg = json.loads(line)
    if "error" in msg:
      raise WorkerError(f"{self.name} failed: {msg['error'].strip().splitlines()[-1]}")
    return msg

  def request(self, timeout: float, **cmd) -> dict:
    self.send(**cmd)
    return self.recv(timeout)

  def stderr_tail(self) -> str:
    lines = []
    for log in self.logs:
      try:
        text = log.read_text(errors="replace").strip().splitlines()
      except OSError:
        continue
      lines += [l for l in text if l.strip() and not l.startswith(("W0", "I0"))][-3:]
    errors = [l for l in lines if "Error" in l or "error" in l]
    return (errors or lines or ["(no output)"])[-1].strip()[:300]

  def close(self) -> None:
    """Asks the processes to quit, then kills whatever is left."""
    self.send(op="quit")
    for p in self.procs:
      try:
        p.stdin.close()
      except OSError:
        pass
    deadline = time.monotonic() + QUIT_TIMEOUT
    for p in self.procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    for p in self.procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)  # its own session: only its group
        except ProcessLookupError:
          pass
        p.wait(timeout=30)
      if p.stdout:
        p.stdout.close()


def _parse_map(text: str) -> dict:
  return {k: int(v) for k, v in (kv.split(":") for kv in text.split(",") if kv)}


def _spread(values):
  return [min(values), max(values)]


def compare(replicas: int, frameworks: list, models: list, *, rounds: int,
            steps: dict, warmup: str, peers_python: str, logdir: pathlib.Path,
            log=print) -> tuple[list, dict, dict]:
  """Runs every framework on `replicas` replicas; returns rows, skips, info."""
  skipped, info, workers = {}, {}, {}
  try:
    for name in frameworks:
      fw = FRAMEWORKS[name]
      python = peers_python if fw.peer else sys.executable
      if not pathlib.Path(python).exists():
        skipped[name] = f"no peers' venv at {python} (`make bench` builds it)"
        continue
      workers[name] = Worker(name, fw, python, replicas, models, warmup, logdir)
    for name in list(workers):
      try:
        info[name] = workers[name].recv(READY_TIMEOUT)
        log(f"  {name} ready: {info[name].get('path', '')}")
      except WorkerError as e:
        skipped[name] = str(e)
        log(f"  {name} left out: {e}")
        workers.pop(name).close()
    times = {(m, n): [] for m in models for n in workers}
    live = list(workers)
    for r in range(rounds):
      for m in models:
        k = r % len(live) if live else 0
        for name in live[k:] + live[:k]:
          if name not in workers:
            continue
          try:
            reply = workers[name].request(BLOCK_TIMEOUT, op="run", model=m,
                                          steps=steps[m])
            times[m, name].append(reply["seconds"])
          except WorkerError as e:
            skipped[name] = str(e)
            log(f"  {name} left out: {e}")
            workers.pop(name).close()
      log(f"  round {r + 1}/{rounds} done")
    losses = {}
    for name in list(workers):
      for m in models:
        try:
          losses[m, name] = workers[name].request(BLOCK_TIMEOUT, op="eval", model=m)["loss"]
        except WorkerError as e:
          skipped[name] = str(e)
          workers.pop(name).close()
          break
  finally:
    for w in workers.values():
      w.close()

  rows = []
  for m in models:
    batch = _batch(m)
    base = times.get((m, "jdist"))
    for name in frameworks:
      if name in skipped or name not in info or not times.get((m, name)):
        continue
      t = times[m, name]
      sps = [steps[m] * batch / s for s in t]
      row = {"model": m, "replicas": replicas, "framework": name,
             "label": FRAMEWORKS[name].label, "batch": batch,
             "steps_per_block": steps[m], "rounds": len(t),
             "samples_per_s": statistics.median(sps), "samples_per_s_spread": _spread(sps),
             "loss0": info[name].get("loss0", {}).get(m), "loss": losses.get((m, name)),
             "path": info[name].get("path"), "version": info[name].get("version"),
             "seconds": t}
      if base and len(base) == len(t):
        ratios = [p / j for j, p in zip(base, t)]  # jdist speed / peer speed
        row["jdist_speedup"] = statistics.median(ratios)
        row["jdist_speedup_spread"] = _spread(ratios)
      rows.append(row)
  return rows, skipped, info


def _batch(model: str) -> int:
  sys.path.insert(0, str(WORKERS))
  try:
    import common
  finally:
    sys.path.remove(str(WORKERS))
  return common.MODELS[model]["batch"]


def check_losses(rows: list, rtol: float = 1e-3) -> list:
  """Rows whose final loss strays from jdist's in the same model and replicas."""
  ref = {(r["model"], r["replicas"]): r["loss"] for r in rows if r["framework"] == "jdist"}
  bad = []
  for r in rows:
    j = ref.get((r["model"], r["replicas"]))
    if j is None or r["loss"] is None:
      continue
    if abs(r["loss"] - j) > rtol * max(1.0, abs(j)):
      bad.append(r)
  return bad


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a fast smoke run")
  parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
  parser.add_argument("--frameworks", default=",".join(DEFAULT_FRAMEWORKS))
  parser.add_argument("--models", default="mlp,cnn")
  parser.add_argument("--replicas", help="e.g. 1,2,4")
  parser.add_argument("--rounds", type=int)
  parser.add_argument("--steps", help="steps per timed block, e.g. mlp:1000,cnn:20")
  parser.add_argument("--warmup", help="warm-up steps, e.g. mlp:100,cnn:4")
  parser.add_argument("--peers-python", default=os.environ.get(
      "PEERS_PYTHON", str(DEFAULT_PEERS_PYTHON)))
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else FULL
  args.peers_python = os.path.abspath(args.peers_python)  # workers run elsewhere
  replicas = [int(n) for n in (args.replicas or preset["replicas"]).split(",")]
  frameworks = [f for f in args.frameworks.split(",") if f]
  unknown = sorted(set(frameworks) - set(FRAMEWORKS))
  if unknown:
    parser.error(f"unknown frameworks {unknown}; choose from {sorted(FRAMEWORKS)}")
  models = [m for m in args.models.split(",") if m]
  rounds = args.rounds or preset["rounds"]
  steps = _parse_map(args.steps or preset["steps"])
  warmup = args.warmup or preset["warmup"]
  log = (lambda *a: print(*a, file=sys.stderr, flush=True))
  # A SIGTERM (a caller's timeout) unwinds through the `finally` that stops
  # the workers; workers whose stdin closes exit on their own as well.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

  rows, skipped, versions = [], {}, {}
  with tempfile.TemporaryDirectory(prefix="jdist-peers-") as tmp:
    for n in replicas:
      log(f"{n} replica(s): {', '.join(frameworks)}")
      r, s, info = compare(n, frameworks, models, rounds=rounds, steps=steps,
                           warmup=warmup, peers_python=args.peers_python,
                           logdir=pathlib.Path(tmp), log=log)
      rows += r
      for name, why in s.items():
        skipped.setdefault(name, f"{n} replica(s): {why}")
      for name, msg in info.items():
        versions.setdefault(name, msg.get("version"))
  result = {"rows": rows, "skipped": skipped, "versions": versions,
            "loss_mismatch": [(r["model"], r["replicas"], r["framework"])
                              for r in check_losses(rows)],
            "settings": {"rounds": rounds, "steps": steps, "warmup": warmup,
                         "replicas": replicas}}
  if args.json:
    print(json.dumps(result))
  else:
    for r in rows:
      sp = r.get("jdist_speedup")
      ratio = (f"jdist/peer {sp:6.2f} [{r['jdist_speedup_spread'][0]:.2f}, "
               f"{r['jdist_speedup_spread'][1]:.2f}]" if sp else "")
      print(f"{r['model']:>4} {r['replicas']} rep {r['framework']:>14}: "
            f"{r['samples_per_s']:10.0f} samples/s "
            f"[{r['samples_per_s_spread'][0]:.0f}, {r['samples_per_s_spread'][1]:.0f}] "
            f"loss {r['loss']:.5f}  {ratio}")
    for name, why in skipped.items():
      print(f"left out {name}: {why}")
    if result["loss_mismatch"]:
      print(f"LOSS MISMATCH: {result['loss_mismatch']}")
  return result


if __name__ == "__main__":
  main()
