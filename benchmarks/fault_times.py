"""How long each fault takes to become a clean error (README: "What jdist
guarantees under faults").

Each case runs a small training job (the digits MLP, 4 fake CPU devices,
BackupAndRestore every 4 steps) in a child process and times it from the
fault to the error, or from `fit()` to the error when the fault is there from
the start. Cases that need a tmpfs (a full disk, a read-only directory) run
in a private mount namespace (`unshare`; root or user namespaces) and are
left out where that is not possible.

    python benchmarks/fault_times.py --trials 2      # about 6 minutes
    python benchmarks/fault_times.py --case SIGINT   # the cases named so

Each trial runs every case once (the trials follow each other, so a case's
range spans the machine's load over the run); `--json` adds one JSON line of
the results, and `section()` renders them for benchmarks/RESULTS.md as
`make bench` does.
"""

import argparse
import json
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


def measure(trials: int, names: list | None = None) -> dict:
  """Each case (those in `names`, or all) `trials` times: its seconds per
  trial, or None where it cannot run here."""
  chosen = [(n, c) for n, c in CASES if names is None or n in names]
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
  return {"trials": trials, "rows": list(rows.values())}


def span(seconds: list) -> str:
  """`lo-hi s` over the trials, to the digits the spread allows."""
  def fmt(t):
    return f"{t:.0f}" if t >= 10 else f"{t:.1f}" if t >= 1 else f"{t:.2f}"
  lo, hi = fmt(min(seconds)), fmt(max(seconds))
  return f"{lo} s" if lo == hi else f"{lo}-{hi} s"


def section(res: dict) -> list:
  """The RESULTS.md section of these measurements."""
  lines = [
      "## Faults: time to a clean error (checkpoint rows)",
      "",
      provenance.line(res["provenance"]),
      "",
      "A training job (the digits MLP on 4 fake CPU devices, 1,000 examples, "
      "batch 64, `BackupAndRestore(save_freq=4)`) in a child process; each "
      "case timed from the fault to the error, or from `fit()` when the "
      f"fault is there from the start. The range of {res['trials']} "
      "trial(s); README's \"What jdist guarantees under faults\" quotes it.",
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
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line of the results at the end")
  args = parser.parse_args(argv)
  provenance.report(lambda: measure(args.trials, args.case), section, args.json)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], sys.argv[3])
  else:
    main()
