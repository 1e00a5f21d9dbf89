"""How long each fault takes to become a clean error (docs/faults.md: "What
jdist guarantees under faults").

Each case runs a small training job (the digits MLP, 4 fake CPU devices,
BackupAndRestore every 4 steps) in a child process and times it from the
fault to the error, or from `fit()` to the error when the fault is there from
the start. Cases that need a tmpfs (a full disk, a read-only directory) run
in a private mount namespace (`unshare`; root or user namespaces) and are
left out where that is not possible.

The parameter-server cases run the TensorFlow tutorial's loop (2 workers,
1 server, the digits MLP) in a child process, hang a server or a worker
(threads backend: a server's update blocks, a worker's function sleeps; Ray:
SIGSTOP of the actor's process) and time it from the hang to `join()`'s
`ParameterServerError` (server) or to `join()` returning with every function
run (worker).

    python benchmarks/fault_times.py --trials 2      # about 8 minutes
    python benchmarks/fault_times.py --case SIGINT   # the cases named so
    python benchmarks/fault_times.py --ps            # the hangs only, both
                                                     # backends, timeout 5 s
    python benchmarks/fault_times.py --quick         # the threads backend's
                                                     # hangs, timeout 1 s

Each trial runs every case once (the trials follow each other, so a case's
range spans the machine's load over the run); `--json` adds one JSON line of
the results, and `section()` renders them for benchmarks/RESULTS.md as
`make bench` does.
"""

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402  (RESULTS.md's "from which run")


def child(backup: str, mode: str) -> None:
  """The training job; prints `at <time> <event>` lines for the parent."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, ROOT)
  import numpy as np
  import optax
  import jdist
  from jdist.examples.data import load_digits
  from jdist.examples.models import MLP

  def say(event):
    print(f"at {time.time():.3f} {event}", flush=True)

  class Events(jdist.Callback):
    def on_train_batch_end(self, batch, logs=None):
      say(f"step {self.model.global_step}")
      if mode == "slow":
        time.sleep(0.2)
      if mode == "hold" and self.model.global_step >= 2:
        threading.Event().wait()  # holds the directory until it is killed

  x, y = load_digits(image=False)
  x = x[:1000].copy()
  if mode == "nan":
    x[5 * 64, 0] = np.nan  # batch 5 (step 6) makes the loss NaN
  trainer = jdist.Trainer(MLP(), optimizer=optax.adam(1e-2),
                          loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True))
  say("fit")
  try:
    trainer.fit(x, y[:1000], batch_size=64, epochs=3, verbose=0,
                shuffle=mode != "nan",
                callbacks=[Events(), jdist.TerminateOnNaN(),
                           jdist.BackupAndRestore(backup, save_freq=4)])
  except BaseException as e:
    say(f"error {type(e).__name__}")
    raise
  say(f"done {trainer.global_step}")


def ps_child(backend: str, timeout: float) -> None:
  """Hangs a parameter server, then a worker, of a running tutorial loop;
  prints `at <time> <event>` lines (and the coordinator's log) for the
  parent."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, ROOT)
  import jdist
  from jdist._src.ps import server as server_lib  # the fault goes in there

  def say(event):  # one write: the coordinator's log lines may interleave
    sys.stdout.write(f"at {time.time():.3f} {event}\n")
    sys.stdout.flush()

  logging.basicConfig(stream=sys.stdout, format="log %(message)s")
  if backend == "ray":
    import ray
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
  # Threads backend: once `stuck` is set, the server's updates block.
  stuck, release = threading.Event(), threading.Event()
  push = server_lib.ParameterServer.push

  def push_or_hang(self, *args):
    if stuck.is_set():
      release.wait(3600)
    return push(self, *args)

  if backend == "threads":  # (Ray pickles the class to its actors)
    server_lib.ParameterServer.push = push_or_hang
  for case in ("server", "worker"):
    coordinator, step_fn, iterator = ps_job(jdist, backend, timeout)
    say(f"{case} hangs")
    if case == "server" and backend == "ray":
      os.kill(ray_actor_pids("ParameterServer")[0], signal.SIGSTOP)
    elif case == "server":
      stuck.set()
    elif backend == "ray":
      os.kill(ray_actor_pids("TrainingWorker")[0], signal.SIGSTOP)
    fns = [step_fn] * 20
    if case == "worker" and backend == "threads":
      fns[0] = sleeps_once(step_fn)
    try:
      coordinator.fetch([coordinator.schedule(fn, args=(iterator,))
                         for fn in fns])
      say(f"{case} joined")
    except jdist.ParameterServerError:
      say(f"{case} error ParameterServerError")
    if case == "server" and backend == "ray":
      os.kill(ray_actor_pids("ParameterServer")[0], signal.SIGCONT)
    stuck.clear()
    release.set()
    coordinator.shutdown()


def sleeps_once(fn):
  """`fn`, but its first call sleeps for an hour first (threads backend)."""
  first = threading.Lock()

  def sleepy(*args):
    if first.acquire(blocking=False):
      time.sleep(3600)
    return fn(*args)

  return sleepy


def ps_job(jdist, backend, timeout):
  """The tutorial's loop on 2 workers and 1 server, both workers warm."""
  import jax
  import numpy as np
  import optax
  from jdist.examples.data import load_digits
  from jdist.examples.models import MLP
  from jdist.examples.steps import classifier_step

  x, y = load_digits(image=False)
  model, tx = MLP(hidden=16), optax.sgd(0.1)
  strategy = jdist.ParameterServerStrategy(
      jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1),
      timeout_seconds=timeout, backend=backend)
  train_step = strategy.function(classifier_step(
      lambda p, x: model.apply({"params": p}, x), tx))
  coordinator = jdist.ClusterCoordinator(strategy)
  params = model.init(jax.random.key(0), x[:1])["params"]
  state = strategy.replicate((params, tx.init(params)))

  def dataset_fn(ctx):
    rng = np.random.default_rng(ctx.input_pipeline_id)
    while True:
      i = rng.choice(len(x), 32, replace=False)
      yield {"x": x[i], "y": y[i]}

  def step_fn(iterator):
    _, loss = train_step(state, next(iterator))
    # Which worker ran it: a process (Ray) or a thread (threads backend).
    return strategy.reduce("sum", loss), (
        f"{os.getpid()}/{threading.current_thread().name}")

  iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
  ran = set()
  while len(ran) < 2:  # both workers have compiled the step
    ran |= {w for _, w in coordinator.fetch([
        coordinator.schedule(step_fn, args=(iterator,)) for _ in range(10)])}
  return coordinator, step_fn, iterator


def ray_actor_pids(name: str) -> list:
  """Processes titled `ray::<name>` (Ray names actor processes so)."""
  found = subprocess.run(["pgrep", "-f", f"^ray::{name}($|[ .])"],
                         capture_output=True, text=True)
  return sorted(int(p) for p in found.stdout.split())


def start(backup, mode="plain", env=None):
  return subprocess.Popen(
      [sys.executable, __file__, "--child", backup, mode],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, **(env or {})))


def events(text):
  out = {}
  for line in text.splitlines():
    if line.startswith("at "):
      t, event = line[3:].split(" ", 1)
      out.setdefault(event, float(t))
  return out


def wait_for(proc, event, lines):
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("at ") and line.split(" ", 2)[2].strip() == event:
      return float(line.split()[1])
  raise RuntimeError(f"never saw {event!r}")


def finish(proc, lines=()):
  out, err = proc.communicate(timeout=300)
  return events("".join(lines) + out), err


def case_second_job(tmp):
  backup = os.path.join(tmp, "b")
  holder, seen = start(backup, "hold"), []
  wait_for(holder, "step 2", seen)
  ev, err = finish(start(backup))
  holder.kill()
  holder.communicate()
  assert "CheckpointInUseError" in err, err[-2000:]
  return ev["error CheckpointInUseError"] - ev["fit"], "from fit()"


def case_file_as_directory(tmp):
  path = os.path.join(tmp, "f")
  open(path, "w").close()
  ev, err = finish(start(path))
  assert "CheckpointDirectoryError" in err, err[-2000:]
  return ev["error CheckpointDirectoryError"] - ev["fit"], "from fit()"


def killed_after(backup, step):
  """Backups of a job killed (kill -9) after `step`."""
  proc = start(backup, "slow")
  wait_for(proc, f"step {step}", [])
  proc.kill()
  proc.communicate()


def case_corrupt_restore(tmp):
  backup = os.path.join(tmp, "b")
  killed_after(backup, 9)
  for d, _, files in os.walk(backup):
    for f in files:
      if f == "manifest.ocdbt":
        open(os.path.join(d, f), "w").close()
  ev, err = finish(start(backup))
  assert "CheckpointError" in err, err[-2000:]
  return ev["error CheckpointError"] - ev["fit"], "from fit()"


def case_signal(tmp, signals):
  proc, seen = start(os.path.join(tmp, "b"), "slow"), []
  wait_for(proc, "step 6", seen)
  sent = time.time()
  for s in signals:
    proc.send_signal(s)
    time.sleep(0.05)
  proc.communicate(timeout=120)
  return time.time() - sent, f"from the signal to exit {proc.returncode}"


def case_kill_9_relaunch(tmp):
  backup = os.path.join(tmp, "b")
  killed_after(backup, 6)
  launched = time.time()
  relaunch, seen = start(backup), []
  resumed = wait_for(relaunch, "step 5", seen)
  finish(relaunch, seen)
  return resumed - launched, "relaunch to its first step"


def case_nan(tmp):
  ev, _ = finish(start(os.path.join(tmp, "b"), "nan"))
  last = max(int(k.split()[1]) for k in ev if k.startswith("step "))
  return ev["done " + str(last)] - ev["step 6"], (
      f"from the NaN step (6) to the end of fit (stopped after step {last})")


def fake_lock(backup, age=0.0):
  os.makedirs(backup, exist_ok=True)
  path = os.path.join(backup, "jdist.lock")
  with open(path, "w") as f:
    json.dump({"token": "t", "host": "elsewhere", "machine": "elsewhere",
               "pid": 1, "processes": 1, "since": "-", "command": "-"}, f)
  os.utime(path, (time.time() - age,) * 2)
  return path


def case_remote_owner(tmp, alive):
  backup = os.path.join(tmp, "b")
  path = fake_lock(backup)
  stop = threading.Event()

  def heartbeat():  # the other machine's job, refreshing every 10 s
    while alive and not stop.wait(10.0):
      os.utime(path)

  thread = threading.Thread(target=heartbeat, daemon=True)
  thread.start()
  ev, err = finish(start(backup))
  stop.set()
  if alive:
    return ev["error CheckpointInUseError"] - ev["fit"], "from fit()"
  assert "taking it over" in err
  return ev["step 1"] - ev["fit"], "from fit() to its first step"


def unshare_flags():
  for flags in (["-m"], ["-rm"]):
    probe = subprocess.run(["unshare", *flags, "sh", "-c", 'd=$(mktemp -d) && '
                            'mount -t tmpfs tmpfs "$d" && umount "$d" && '
                            'rmdir "$d"'], capture_output=True)
    if shutil.which("unshare") and probe.returncode == 0:
      return flags
  return None


def case_tmpfs(tmp, options, error):
  flags = unshare_flags()
  if flags is None:
    return None, "needs a mount namespace"
  fs = os.path.join(tmp, "fs")
  os.mkdir(fs)
  cmd = (f"mount -t tmpfs -o {options} tmpfs {fs} && {sys.executable} "
         f"{__file__} --child {fs}/b plain")
  done = subprocess.run(["unshare", *flags, "sh", "-c", cmd],
                        capture_output=True, text=True, timeout=300)
  ev = events(done.stdout)
  assert error in done.stderr, done.stderr[-2000:]
  if "ro" in options.split(","):
    return ev[f"error {error}"] - ev["fit"], "from fit()"
  last = max(int(k.split()[1]) for k in ev if k.startswith("step "))
  return ev[f"error {error}"] - ev[f"step {last}"], (
      f"from the failing save (step {last})")


CASES = [
    ("second job on the backup directory (same machine)", case_second_job),
    ("second job, owner alive on another machine",
     lambda t: case_remote_owner(t, alive=True)),
    ("owner dead on another machine (lock not refreshed)",
     lambda t: case_remote_owner(t, alive=False)),
    ("backup path is a file", case_file_as_directory),
    ("read-only directory", lambda t: case_tmpfs(
        t, "ro,size=64k", "CheckpointDirectoryError")),
    ("full disk", lambda t: case_tmpfs(t, "size=200k", "CheckpointError")),
    ("every backup corrupt", case_corrupt_restore),
    ("NaN loss with TerminateOnNaN", case_nan),
    ("SIGINT", lambda t: case_signal(t, [signal.SIGINT])),
    ("SIGTERM twice", lambda t: case_signal(t, [signal.SIGTERM] * 2)),
    ("kill -9, then relaunch", case_kill_9_relaunch),
    ("SIGTERM once", lambda t: case_signal(t, [signal.SIGTERM])),
]


PS_HANGS = ("parameter server hangs", "worker hangs in a function")
PS_FAULTS = {f"{what} ({backend})" for backend in ("threads", "ray")
             for what in PS_HANGS}


def ps_cases(backend: str, timeout: float) -> list:
  """Rows `(name, seconds, what)` of a hung server and a hung worker."""
  proc = subprocess.Popen(
      [sys.executable, __file__, "--ps-child", backend, str(timeout)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  out, err = proc.communicate(timeout=600)
  ev = events(out)
  assert proc.returncode == 0, err[-3000:]
  assert "server error ParameterServerError" in ev, (ev, err[-3000:])
  assert "worker joined" in ev, (ev, err[-3000:])
  assert "\nlog Worker " in out, out  # the lost worker was logged
  what = f"timeout_seconds={timeout:g}, from the hang"
  return [
      (f"{PS_HANGS[0]} ({backend})",
       ev["server error ParameterServerError"] - ev["server hangs"],
       f"{what} to join()'s ParameterServerError"),
      (f"{PS_HANGS[1]} ({backend})",
       ev["worker joined"] - ev["worker hangs"],
       f"{what} to join() returning, every function run"),
  ]


def measure(trials: int, names: list | None = None, *,
            ps_backends: tuple = ("threads", "ray"), ps_timeout: float = 5.0,
            checkpoint_cases: bool = True) -> dict:
  """Each case (those in `names`, or all) `trials` times: its seconds per
  trial, or None where it cannot run here. Without `names`, the
  parameter-server hangs on `ps_backends` too."""
  chosen = [(n, c) for n, c in CASES if (names is None and checkpoint_cases)
            or n in (names or ())]
  unknown = set(names or ()) - {n for n, _ in CASES}
  if unknown:
    raise SystemExit(f"no such case: {sorted(unknown)}; the cases: "
                     f"{[n for n, _ in CASES]}")
  rows = {n: {"fault": n, "seconds": [], "measured": None} for n, _ in chosen}
  for trial in range(trials):
    for name, case in chosen:
      with tempfile.TemporaryDirectory() as tmp:
        seconds, what = case(tmp)
      rows[name]["seconds"].append(seconds)
      rows[name]["measured"] = what
      shown = "-" if seconds is None else f"{seconds:.2f}"
      print(f"| {trial + 1} | {name} | {shown} | {what} |", file=sys.stderr,
            flush=True)
    for backend in ps_backends if names is None else ():
      for name, seconds, what in ps_cases(backend, ps_timeout):
        row = rows.setdefault(name, {"fault": name, "seconds": []})
        row["seconds"].append(seconds)
        row["measured"] = what
        print(f"| {trial + 1} | {name} | {seconds:.2f} | {what} |",
              file=sys.stderr, flush=True)
  return {"trials": trials, "rows": list(rows.values())}


def span(seconds: list) -> str:
  """`lo-hi s` over the trials, to the digits the spread allows."""
  def fmt(t):
    return f"{t:.0f}" if t >= 10 else f"{t:.1f}" if t >= 1 else f"{t:.2f}"
  lo, hi = fmt(min(seconds)), fmt(max(seconds))
  return f"{lo} s" if lo == hi else f"{lo}-{hi} s"


def section(res: dict) -> list:
  """The RESULTS.md section of these measurements."""
  ps_rows = [r for r in res["rows"] if r["fault"] in PS_FAULTS]
  kinds = " and ".join(k for k, there in (
      ("checkpoint", len(ps_rows) < len(res["rows"])),
      ("parameter-server", ps_rows)) if there)
  lines = [
      f"## Faults: time to a clean error ({kinds} rows)",
      "",
      provenance.line(res["provenance"]),
      "",
      " ".join(part for part, there in (
          ("Checkpoint rows: a training job (the digits MLP on 4 fake CPU "
           "devices, 1,000 examples, batch 64, "
           "`BackupAndRestore(save_freq=4)`) in a child process; each case "
           "timed from the fault to the error, or from `fit()` when the "
           "fault is there from the start.",
           len(ps_rows) < len(res["rows"])),
          ("Parameter-server rows: TensorFlow's tutorial loop (2 workers, 1 "
           "server, the digits MLP) in a child process, timed from the hang.",
           bool(ps_rows)),
          (f"The range of {res['trials']} trial(s); the docs' \"What "
           "jdist guarantees under faults\" page quotes it.", True)) if there),
      "",
      "| fault | seconds | measured |",
      "|---|---|---|",
  ]
  for r in res["rows"]:
    got = [t for t in r["seconds"] if t is not None]
    lines.append(f"| {r['fault']} | {span(got) if got else '-'} | "
                 f"{r['measured']} |")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trials", type=int, default=1,
                      help="runs of every case; the section shows their range")
  parser.add_argument("--case", action="append",
                      help="a case to run (by its name; repeatable): only those")
  parser.add_argument("--ps", action="store_true",
                      help="only the parameter-server hangs, both backends")
  parser.add_argument("--quick", action="store_true",
                      help="only the threads backend's hangs, timeout 1 s")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line of the results at the end")
  args = parser.parse_args(argv)
  options = {}
  if args.ps or args.quick:
    options = dict(checkpoint_cases=False)
  if args.quick:
    options.update(ps_backends=("threads",), ps_timeout=1.0)
  provenance.report(lambda: measure(args.trials, args.case, **options),
                    section, args.json)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], sys.argv[3])
  elif sys.argv[1:2] == ["--ps-child"]:
    ps_child(sys.argv[2], float(sys.argv[3]))
  else:
    main()
