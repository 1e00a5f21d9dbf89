"""How long an elastic job takes to train again after a fault
(docs/elastic.md), and what in-memory snapshots cost the step loop.

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
alternating trials, by the wall clock and in CPU time of the loop's thread;
`--baseline DIR` also runs it with the jdist of the checkout DIR, its runs
alternating with this checkout's.

    python benchmarks/elastic_times.py --trials 3     # a few minutes
    python benchmarks/elastic_times.py --case kill    # one case, no loop
    python benchmarks/elastic_times.py --case kill --case kill-memory --loop
    python benchmarks/elastic_times.py --loop-only --loop-runs 4 \
        --baseline /tmp/base   # the loop, against a checkout of another commit

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


def job_env(code: str = ROOT) -> dict:
  """The jobs' environment; `code`: the checkout whose jdist they import."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JDIST_", "TF_CONFIG", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join([code, env.get("PYTHONPATH", "")]))
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


def run_loop(code: str = ROOT) -> dict:
  """snapshot_loop.py (this checkout's) on 2 processes, with the jdist of
  checkout `code`: its seconds per step of each trial."""
  done = subprocess.run(
      [sys.executable, "-m", "jdist.launch", "-n", "2",
       "--devices-per-process", "1", LOOP], env=job_env(code), cwd=code,
      capture_output=True, text=True, timeout=900)
  found = re.search(r"^\[0\] (\{.*\})$", done.stdout, re.M)
  if done.returncode or not found:
    raise RuntimeError(f"snapshot_loop.py failed (exit {done.returncode}):\n"
                       f"{done.stderr[-3000:]}")
  return json.loads(found.group(1))


def pooled(runs: list) -> dict:
  """The runs of snapshot_loop.py as one: their trials end to end (each
  trial stays with the trials of its round), the medians of their `save`
  times."""
  loop = dict(runs[0], trials=sum(r["trials"] for r in runs), runs=len(runs))
  for key in ("seconds_per_step", "cpu_seconds_per_step",
              "process_cpu_seconds_per_step"):
    if all(key in r for r in runs):
      loop[key] = {k: [t for r in runs for t in r[key][k]]
                   for k in runs[0][key]}
  for key in ("snapshot_seconds", "unreplicated_seconds"):
    if all(r.get(key) for r in runs):
      loop[key] = {k: statistics.median(r[key][k] for r in runs)
                   for k in runs[0][key]}
  if all(r.get("position_seconds") for r in runs):
    loop["position_seconds"] = {
        k: [statistics.median(p) for p in zip(*(r["position_seconds"][k]
                                                for r in runs))]
        for k in runs[0]["position_seconds"]}
  return loop


def measure(trials: int, names: list, loop: bool, loop_runs: int = 1,
            baseline: str | None = None) -> dict:
  rows = {n: {"case": n, "what": CASES[n][0], "seconds": []} for n in names}
  for trial in range(trials):
    for name in names:
      rows[name]["seconds"].append(run_case(name))
      print(f"trial {trial + 1}, {name}: {rows[name]['seconds'][-1]}",
            file=sys.stderr, flush=True)
  res = {"trials": trials, "rows": list(rows.values())}
  if loop:
    # With a baseline: runs of this checkout's jdist and of the baseline's,
    # alternating, so that both meet the same load.
    codes = [ROOT] if baseline is None else [ROOT, os.path.abspath(baseline)]
    runs = {code: [] for code in codes}
    for i in range(loop_runs):
      for code in codes[i % len(codes):] + codes[:i % len(codes)]:
        runs[code].append(run_loop(code))
        print(f"loop run {i + 1} ({code}): {runs[code][-1]}", file=sys.stderr,
              flush=True)
    res["loop"] = pooled(runs[ROOT])
    if baseline is not None:
      res["baseline_loop"] = pooled(runs[codes[1]])
  return res


def loop_section(loop: dict) -> list:
  """The loop's lines: each variant's median (and fastest) time per step,
  by the wall clock and in the main thread's CPU time, and its speed
  against no snapshots (the median of the ratios of the trials of one
  round)."""
  t = loop["seconds_per_step"]
  cpu = loop.get("cpu_seconds_per_step")
  process = loop.get("process_cpu_seconds_per_step") if cpu else None

  def paired(times: dict, name: str) -> float:
    return statistics.median(a / b for a, b in zip(times["none"], times[name]))

  def cells(times: dict, name: str) -> str:
    return (f"{statistics.median(times[name]) * 1e3:.2f} "
            f"({min(times[name]) * 1e3:.2f})")

  def row(name: str, what: str) -> str:
    line = (f"| {what} | {cells(t, name)} | "
            + ("1 | 1 | 1" if name == "none" else
               f"{paired(t, name):.3f} | {of_medians(t, name):.3f} | "
               f"{of_totals(t, name):.3f}") + " |")
    for times in (cpu, process):
      if times:
        line += (f" {cells(times, name)} | " + (
            "1" if name == "none" else f"{paired(times, name):.3f}") + " |")
    return line

  def split_line(split: dict, what: str) -> str:
    line = (f"{what}, median: {split['take'] * 1e3:.2f} ms in the `save` "
            "that takes it, "
            f"{split['write'] * 1e3:.2f} ms in the next `save`, which writes "
            "it (or hands it to the writer thread)")
    if "cpu_take" in split:
      line += (f"; in CPU time of the loop's thread {split['cpu_take'] * 1e3:.3f}"
               f" ms and {split['cpu_write'] * 1e3:.3f} ms")
      if split.get("writer_cpu"):
        line += (f", and {split['writer_cpu'] * 1e3:.3f} ms of the writer "
                 "thread's")
    return line + "."

  unreplicated = "unreplicated" in t
  runs = loop.get("runs", 1)
  lines = [
      "",
      f"The seed MLP's custom loop on 2 processes x 1 CPU device "
      f"(`benchmarks/snapshot_loop.py` under `jdist launch -n 2`, "
      f"{loop['steps']} steps a trial, {loop['trials']} rounds of one trial "
      "of each loop"
      + (f", in {runs} runs" if runs > 1 else "") + "), "
      f"with `CheckpointManager.save` at every step and a snapshot in memory "
      f"every {loop['every']} steps"
      + (" (of the parameters, mirrored, and a leaf as large split over the "
         "processes)" if unreplicated else "")
      + (", with each process's part replicated on the other process and "
         "without (the replicas turned off inside the manager)"
         if unreplicated else "") + ", against no manager. Speed: the "
      "median of the rounds' ratios (no snapshot's time over the loop's)"
      + (", by the wall clock and in CPU time of the main thread "
         "(`time.thread_time`: the loop's own work)" if cpu else "")
      + (" and of the whole process (`time.process_time`: also the "
         "runtime's threads and the snapshots' writer)" if process else "")
      + ":",
      "",
      "| loop | wall ms per step, median (fastest) | speed, wall "
      "(median of the rounds' ratios) | ratio of the medians | ratio of the "
      "totals |"
      + (" main thread CPU ms per step, median (least) | speed, CPU |"
         if cpu else "")
      + (" process CPU ms per step, median (least) | speed, process CPU |"
         if process else ""),
      "|---|---|---|---|---|" + ("---|---|" if cpu else "")
      + ("---|---|" if process else ""),
      row("none", "no snapshot"),
      row("snapshot", f"a snapshot every {loop['every']} steps"
          + (", replicated" if unreplicated else "")),
  ]
  if unreplicated:
    lines.append(row("unreplicated", f"a snapshot every {loop['every']} "
                     "steps, no replica"))
  lines += ["", "The 0.95x target reads the speed by the wall clock, the "
            "median of the rounds' ratios: each ratio compares trials run "
            "within a few milliseconds of each other, which the machine's "
            "slow swings (a step's time moves by 2-4x from one moment to "
            "another) leave alone. The ratio of the medians compares the "
            "loops' typical trials, and the ratio of the totals (their "
            "seconds summed over every round) is the speed over the whole "
            "run, the long tails included."]
  lines += position_lines(loop)
  if loop.get("snapshot_seconds"):
    lines += ["", split_line(
        loop["snapshot_seconds"],
        "A snapshot on process 0" + (", replicated" if unreplicated else "")
        + " (taking it dispatches the copies of its blocks, to a buffer or "
        "to the host"
        + (", and to the other process" if unreplicated else "")
        + "; writing it is the copy to the host, the checksum, the file and "
        "its rename" + (", and the replica's" if unreplicated else "") + ")")]
  if loop.get("unreplicated_seconds"):
    lines += ["", split_line(loop["unreplicated_seconds"],
                             "Without the replica")]
  return lines


def of_medians(times: dict, name: str) -> float:
  return statistics.median(times["none"]) / statistics.median(times[name])


def of_totals(times: dict, name: str) -> float:
  return sum(times["none"]) / sum(times[name])


def position_lines(loop: dict) -> list:
  """The table of a step's median time (with its `save`) by its place
  among the steps of a snapshot."""
  positions = loop.get("position_seconds")
  if not positions:
    return []
  every = loop["every"]
  lines = ["", "A step and its `save`, median ms, by the step's place "
           "among the " + str(every) + " of a snapshot (0: its `save` takes "
           "the snapshot; 1: its `save` hands it to the writer thread; 2: "
           "the writer thread writes it beside this step; 1 is also a "
           "trial's first step, whose dispatch returns before it has run, "
           "so that its time shows in 2's, for every loop alike):", "",
           "| loop | " + " | ".join(str(p) for p in range(every))
           + " | sum |", "|---|" + "---|" * (every + 1)]
  for name, values in positions.items():
    lines.append(f"| {name} | " + " | ".join(f"{v * 1e3:.2f}" for v in values)
                 + f" | {sum(values) * 1e3:.2f} |")
  return lines


def section(res: dict) -> list:
  """The RESULTS.md section of these measurements."""
  if not res["rows"]:  # the loop only
    lines = ["## Elastic training: the step loop with snapshots in memory", "",
             provenance.line(res["provenance"])]
  else:
    lines = _cases_lines(res)
  if "baseline_loop" in res:
    lines += ["", "With the jdist of this checkout:"]
  if "loop" in res:
    lines += loop_section(res["loop"])
  if "baseline_loop" in res:
    lines += ["", f"With the jdist of `{res['baseline_loop']['jdist']}` (the "
              "baseline, its runs alternating with these):"]
    lines += loop_section(res["baseline_loop"])
  return lines


def _cases_lines(res: dict) -> list:
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
      f"process's marker). The range of {res['trials']} trial(s); the "
      "docs' \"Elastic training\" page quotes it.",
      "",
      "| fault | in all | " + " | ".join(PARTS.values()) + " |",
      "|---|---|" + "---|" * len(PARTS),
  ]
  for r in res["rows"]:
    cells = [fault_times.span([s[k] for s in r["seconds"]])
             for k in ("total", *PARTS)]
    lines.append(f"| {r['what']} | " + " | ".join(cells) + " |")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trials", type=int, default=1)
  parser.add_argument("--case", action="append", choices=list(CASES),
                      help="a case to run (repeatable): only those")
  parser.add_argument("--loop", action="store_true",
                      help="with --case: also time the step loop with and "
                      "without snapshots (without --case it is timed)")
  parser.add_argument("--loop-only", action="store_true",
                      help="time the step loop only, no fault case")
  parser.add_argument("--loop-runs", type=int, default=1,
                      help="run the loop's benchmark this many times "
                      "(pooled)")
  parser.add_argument("--baseline", metavar="DIR",
                      help="also run the loop with the jdist of the checkout "
                      "DIR (another commit), each run alternating with this "
                      "checkout's")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line of the results at the end")
  args = parser.parse_args(argv)
  provenance.report(
      lambda: measure(args.trials,
                      [] if args.loop_only else args.case or list(CASES),
                      args.loop or args.loop_only or not args.case,
                      args.loop_runs,
                      args.baseline), section, args.json)


if __name__ == "__main__":
  main()
