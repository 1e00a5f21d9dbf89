"""How long an elastic job takes to train again after a fault (README:
"Elastic training"), and what in-memory snapshots cost the step loop.

Each case runs `jdist launch` on tests/multiprocess/elastic_job.py (60 steps
of a small MLP with SGD and momentum, one CPU device per process, a
`jdist.CheckpointManager` save every 10 steps, or a snapshot in memory every
10 steps and a save every 50), with one process killing, stopping or hanging
itself at a known step, and reads the processes' timestamped markers: from
the fault to the first step after it, split into the launcher's part (the
fault to the new processes' start), starting Python and importing jdist and
JAX, `jax.distributed.initialize`, reading the checkpoint (opening the
manager and restoring, from disk or from memory), and compiling and running
the first step. The loop (`snapshot_loop.py` under `jdist launch -n 2`):
seconds per step of the seed MLP's custom loop with a snapshot every 10
steps (replicated on the other process, and not) and without, in
alternating trials.

    python benchmarks/elastic_times.py --trials 3     # a few minutes
    python benchmarks/elastic_times.py --case kill    # one case, no loop
    python benchmarks/elastic_times.py --case kill --case kill-memory --loop

`--json` adds one JSON line of the results; `section()` renders them for
benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOB = os.path.join(ROOT, "tests", "multiprocess", "elastic_job.py")
LOOP = os.path.join(HERE, "snapshot_loop.py")
sys.path.insert(0, HERE)
import fault_times  # noqa: E402  (its ranges)
import provenance  # noqa: E402  (RESULTS.md's "from which run")

# name: (what happens, the launcher's options, the job's options and faults)
CASES = {
    "kill": ("a process dies (SIGKILL at step 30), `--nnodes 2:4`",
             ["--nnodes", "2:4", "--max-restarts", "3"], ["0:2:30:kill"]),
    "kill-memory": ("the same, resumed from the in-memory snapshot of step "
                    "30 (`snapshot_every=10, save_every=50`)",
                    ["--nnodes", "2:4", "--max-restarts", "3"],
                    ["--snapshot-every", "10", "--save-every", "50",
                     "0:2:30:kill"]),
    "stop": ("a process is stopped (SIGSTOP at step 30), `--nnodes 3 "
             "--stuck-timeout 5`",
             ["--nnodes", "3", "--max-restarts", "2", "--stuck-timeout", "5"],
             ["0:2:30:stop"]),
    "hang": ("a process hangs, alive, outside its step (after step 30), "
             "`--nnodes 3 --stuck-timeout 5`",
             ["--nnodes", "3", "--max-restarts", "2", "--stuck-timeout", "5"],
             ["0:1:30:hang"]),
}
# The markers between the fault and the first step after it, and what the
# time up to each one is.
PARTS = {"started": "the launcher", "imported": "Python, jdist and JAX",
         "initialized": "`jax.distributed.initialize`",
         "resumed": "reading the checkpoint", "step": "compiling and the first step"}


def stamps(output: str, name: str) -> list:
  """The wall times of the processes' `[rank] name ...` markers."""
  return [float(t) for t in re.findall(
      rf"^\[\d+\] {name} .*?(\d{{9,}}\.\d+)", output, re.M)]


def fault_to_step(output: str) -> dict:
  """Seconds from the fault to each part's end (the slowest process's), and
  in all to the first step after it."""
  fault = stamps(output, "fault")[0]
  restart = min(t for t in stamps(output, "started") if t > fault)
  ends = {"started": restart}
  for name in list(PARTS)[1:]:
    later = [t for t in stamps(output, name) if t > restart]
    ends[name] = min(later) if name == "step" else max(later)
  times = [fault, *ends.values()]
  return {"total": times[-1] - fault,
          **{k: b - a for k, a, b in zip(ends, times, times[1:])}}


def job_env() -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JDIST_", "TF_CONFIG", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
  return env


def run_case(name: str) -> dict:
  _, options, faults = CASES[name]
  env = job_env()
  with tempfile.TemporaryDirectory() as out:
    done = subprocess.run(
        [sys.executable, "-m", "jdist.launch", *options,
         "--devices-per-process", "1", JOB, out, *faults],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    finished = os.path.exists(os.path.join(out, "final.npz"))
  if done.returncode or not finished:
    raise RuntimeError(f"case {name}: the job did not finish "
                       f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
  return fault_to_step(done.stdout)


def run_loop() -> dict:
  """snapshot_loop.py on 2 processes: its seconds per step of each trial."""
  done = subprocess.run(
      [sys.executable, "-m", "jdist.launch", "-n", "2",
       "--devices-per-process", "1", LOOP], env=job_env(), cwd=ROOT,
      capture_output=True, text=True, timeout=900)
  found = re.search(r"^\[0\] (\{.*\})$", done.stdout, re.M)
  if done.returncode or not found:
    raise RuntimeError(f"snapshot_loop.py failed (exit {done.returncode}):\n"
                       f"{done.stderr[-3000:]}")
  return json.loads(found.group(1))


def measure(trials: int, names: list, loop: bool) -> dict:
  rows = {n: {"case": n, "what": CASES[n][0], "seconds": []} for n in names}
  for trial in range(trials):
    for name in names:
      rows[name]["seconds"].append(run_case(name))
      print(f"trial {trial + 1}, {name}: {rows[name]['seconds'][-1]}",
            file=sys.stderr, flush=True)
  res = {"trials": trials, "rows": list(rows.values())}
  if loop:
    res["loop"] = run_loop()
    print(f"loop: {res['loop']}", file=sys.stderr, flush=True)
  return res


def loop_section(loop: dict) -> list:
  """The loop's lines: each variant's median (and fastest) time per step."""
  t = loop["seconds_per_step"]
  med = {k: statistics.median(v) for k, v in t.items()}

  def row(name: str, what: str) -> str:
    paired = statistics.median(a / b for a, b in zip(t["none"], t[name]))
    return (f"| {what} | {med[name] * 1e3:.2f} ({min(t[name]) * 1e3:.2f}) | "
            f"{med['none'] / med[name]:.3f} (of the medians), {paired:.3f} "
            "(median of the trials' ratios) |")

  def split_line(split: dict, what: str) -> str:
    return (f"{what}, median: {split['take'] * 1e3:.2f} ms in the `save` "
            "that takes it, "
            f"{split['write'] * 1e3:.2f} ms in the next `save`, which writes "
            "it.")

  unreplicated = "unreplicated" in t
  lines = [
      "",
      f"The seed MLP's custom loop on 2 processes x 1 CPU device "
      f"(`benchmarks/snapshot_loop.py` under `jdist launch -n 2`, "
      f"{loop['steps']} steps a trial, {loop['trials']} alternating trials), "
      f"with `CheckpointManager.save` at every step and a snapshot in memory "
      f"every {loop['every']} steps"
      + (" (of the parameters, mirrored, and a leaf as large split over the "
         "processes)" if unreplicated else "")
      + (", with each process's part replicated on the other process and "
         "without (the replicas turned off inside the manager)"
         if unreplicated else "") + ", against no manager:",
      "",
      "| loop | ms per step, median (fastest) | speed against none |",
      "|---|---|---|",
      f"| no snapshot | {med['none'] * 1e3:.2f} ({min(t['none']) * 1e3:.2f}) | 1 |",
      row("snapshot", f"a snapshot every {loop['every']} steps"
          + (", replicated" if unreplicated else "")),
  ]
  if unreplicated:
    lines.append(row("unreplicated", f"a snapshot every {loop['every']} "
                     "steps, no replica"))
  if loop.get("snapshot_seconds"):
    lines += ["", split_line(
        loop["snapshot_seconds"],
        "A snapshot on process 0" + (", replicated" if unreplicated else "")
        + " (taking it starts the copies to the host"
        + (" and to the other process" if unreplicated else "")
        + "; writing it is the copy, the checksum, the file and its rename"
        + (", and the replica's" if unreplicated else "") + ")")]
  if loop.get("unreplicated_seconds"):
    lines += ["", split_line(loop["unreplicated_seconds"],
                             "Without the replica")]
  return lines


def section(res: dict) -> list:
  """The RESULTS.md section of these measurements."""
  lines = [
      "## Elastic training: time to training again",
      "",
      provenance.line(res["provenance"]),
      "",
      "`jdist launch` on tests/multiprocess/elastic_job.py (60 steps of a small "
      "MLP, one CPU device per process, a `jdist.CheckpointManager` save every "
      "10 steps, or where it says so a snapshot in memory every 10 steps and a "
      "save every 50); from the fault to "
      "the first step after it, and its parts (each up to the slowest "
      f"process's marker). The range of {res['trials']} trial(s); README's "
      "\"Elastic training\" quotes it.",
      "",
      "| fault | in all | " + " | ".join(PARTS.values()) + " |",
      "|---|---|" + "---|" * len(PARTS),
  ]
  for r in res["rows"]:
    cells = [fault_times.span([s[k] for s in r["seconds"]])
             for k in ("total", *PARTS)]
    lines.append(f"| {r['what']} | " + " | ".join(cells) + " |")
  if "loop" in res:
    lines += loop_section(res["loop"])
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trials", type=int, default=1)
  parser.add_argument("--case", action="append", choices=list(CASES),
                      help="a case to run (repeatable): only those")
  parser.add_argument("--loop", action="store_true",
                      help="with --case: also time the step loop with and "
                      "without snapshots (without --case it is timed)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line of the results at the end")
  args = parser.parse_args(argv)
  provenance.report(
      lambda: measure(args.trials, args.case or list(CASES),
                      args.loop or not args.case), section, args.json)


if __name__ == "__main__":
  main()
