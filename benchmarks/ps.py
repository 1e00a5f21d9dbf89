"""Asynchronous training: jdist's ParameterServerStrategy against TensorFlow's.

Both run TensorFlow's parameter-server tutorial loop on the seed MLP (Dense
16, Dense 10 on 10 features, global batch 256 per step, SGD) from the same
initial weights: N workers and one parameter server, per-worker datasets of
the same synthetic batches, one scheduled function per step, `join()` at the
end of each timed block. jdist runs its threads backend with 1, 2 and 4
workers and its Ray backend (a local Ray cluster) with 2; TensorFlow runs
in-process `tf.distribute.Server`s (its tutorial's cluster) from the peers'
venv. Each configuration is a long-lived process (benchmarks/peers/
jdist_ps.py and tf_ps.py); the frameworks' blocks alternate round by round,
and the ratio jdist / TensorFlow is the median of per-round ratios.

  python benchmarks/ps.py [--quick] [--json] [--peers-python .venv-peers/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402  (the worker-process plumbing)

FRAMEWORKS = {
    "jdist": peers.Framework("jdist, threads", "jdist_ps.py", peer=False),
    "jdist_ray": peers.Framework("jdist, Ray actors", "jdist_ps.py", peer=False,
                                 args=("--backend", "ray")),
    "tf": peers.Framework("TensorFlow, in-process servers", "tf_ps.py"),
}
# Workers -> frameworks run with that many workers.
FULL = {"workers": {1: ["jdist", "tf"], 2: ["jdist", "jdist_ray", "tf"],
                    4: ["jdist", "tf"]},
        "rounds": 5, "steps": 400, "warmup": 60}
QUICK = {"workers": {2: ["jdist", "tf"]}, "rounds": 1, "steps": 20,
         "warmup": 5}
BATCH = 256


def compare(workers: int, names: list, *, rounds: int, steps: int,
            warmup: int, peers_python: str, logdir, log) -> tuple:
  """Runs `names` with `workers` workers; returns (rows, skipped)."""
  running, skipped, info = {}, {}, {}
  try:
    for name in names:
      fw = FRAMEWORKS[name]
      python = peers_python if fw.peer else sys.executable
      if not pathlib.Path(python).exists():
        skipped[name] = f"no peers' venv at {python} (`make bench` builds it)"
        continue
      running[name] = peers.Worker(name, fw, python, workers, ["mlp"],
                                   f"mlp:{warmup}", logdir)
    for name in list(running):
      try:
        info[name] = running[name].recv(peers.READY_TIMEOUT)
      except peers.WorkerError as e:
        skipped[name] = str(e)
        running.pop(name).close()
    times = {name: [] for name in running}
    for r in range(rounds):
      order = list(running)
      order = order[r % len(order):] + order[:r % len(order)] if order else []
      for name in order:
        try:
          reply = running[name].request(peers.BLOCK_TIMEOUT, op="run",
                                        model="mlp", steps=steps)
          times[name].append(reply["seconds"])
        except peers.WorkerError as e:
          skipped[name] = str(e)
          running.pop(name).close()
          times.pop(name)
      log(f"  {workers} worker(s): round {r + 1}/{rounds}")
    losses = {}
    for name in list(running):
      try:
        losses[name] = running[name].request(peers.BLOCK_TIMEOUT, op="eval",
                                              model="mlp")["loss"]
      except peers.WorkerError as e:
        skipped[name] = str(e)
        times.pop(name, None)
  finally:
    for w in running.values():
      w.close()
  rows = []
  tf_times = times.get("tf")
  for name, t in times.items():
    speeds = [steps * BATCH / s for s in t]
    row = {"workers": workers, "framework": name,
           "label": FRAMEWORKS[name].label, "examples_per_s":
           statistics.median(speeds), "spread": [min(speeds), max(speeds)],
           "loss0": info[name].get("loss0", {}).get("mlp"),
           "loss": losses.get(name), "version": info[name].get("version")}
    if tf_times and name != "tf" and len(tf_times) == len(t):
      ratios = [b / a for a, b in zip(t, tf_times)]  # jdist speed / TF speed
      row["vs_tf"] = statistics.median(ratios)
      row["vs_tf_spread"] = [min(ratios), max(ratios)]
    rows.append(row)
  return rows, skipped


def section(res: dict) -> list:
  """The RESULTS.md section of this benchmark."""
  if "error" in res:
    return ["## Asynchronous training: ParameterServerStrategy vs TensorFlow",
            "", f"The comparison failed: {res['error']}"]
  st = res["settings"]
  lines = [
      "## Asynchronous training: ParameterServerStrategy vs TensorFlow",
      "",
      "TensorFlow's parameter-server tutorial loop, the same in both: N workers",
      "and one parameter server, per-worker datasets of the same synthetic",
      f"batches, one `coordinator.schedule(step_fn, args=(iterator,))` per step of",
      f"{BATCH} examples (seed MLP 10-16-10, SGD, the same initial weights),",
      f"`join()` after each block of {st['steps']} steps; {st['rounds']} rounds,",
      "the frameworks alternating. jdist: threads backend (workers are threads",
      "on one fake CPU device each) and Ray backend (servers and workers are Ray",
      "actors on a local Ray cluster). TensorFlow: `tf.distribute.Server`s in",
      "one process (its tutorial's in-process cluster), variables on the",
      "parameter server, a `tf.function` step. **jdist / TF** is the median of",
      "per-round speed ratios (above 1: jdist is faster). Losses differ between",
      "runs: updates are asynchronous.",
      "",
      "| workers | framework | examples/s | spread | jdist / TF | spread | loss before -> after |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in res["rows"]:
    ratio = f"**{r['vs_tf']:.2f}**" if "vs_tf" in r else ("1" if r["framework"] == "tf" else "n/a")
    rspread = (f"{r['vs_tf_spread'][0]:.2f} to {r['vs_tf_spread'][1]:.2f}"
               if "vs_tf" in r else "")
    lo, hi = r["spread"]
    loss = (f"{r['loss0']:.3f} -> {r['loss']:.3f}"
            if r.get("loss") is not None and r.get("loss0") is not None else "")
    lines.append(f"| {r['workers']} | {r['label']} | {r['examples_per_s']:,.0f} | "
                 f"{lo:,.0f} to {hi:,.0f} | {ratio} | {rspread} | {loss} |")
  slower = [f"{r['label']} with {r['workers']} ({r['vs_tf']:.2f}x)"
            for r in res["rows"] if r.get("vs_tf", 2) < 1]
  lines += ["", "Slower than TensorFlow here (median): " +
            ("; ".join(slower) or "none") + "."]
  if res["skipped"]:
    lines += ["", "Left out:", ""]
    lines += [f"- {k}: {v}" for k, v in res["skipped"].items()]
  versions = ", ".join(dict.fromkeys(v for v in res["versions"].values() if v))
  lines += ["", f"Versions: {versions}."]
  return lines


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a fast smoke run")
  parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
  parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
  parser.add_argument("--peers-python", default=os.environ.get(
      "PEERS_PYTHON", str(peers.DEFAULT_PEERS_PYTHON)))
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else FULL
  wanted = [f for f in args.frameworks.split(",") if f]
  unknown = sorted(set(wanted) - set(FRAMEWORKS))
  if unknown:
    parser.error(f"unknown frameworks {unknown}; choose from {sorted(FRAMEWORKS)}")
  peers_python = os.path.abspath(args.peers_python)
  log = (lambda *a: print(*a, file=sys.stderr, flush=True))
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  rows, skipped, versions = [], {}, {}
  with tempfile.TemporaryDirectory(prefix="jdist-ps-") as tmp:
    for workers, names in preset["workers"].items():
      names = [n for n in names if n in wanted]
      log(f"{workers} worker(s): {', '.join(names)}")
      r, s = compare(workers, names, rounds=preset["rounds"],
                     steps=preset["steps"], warmup=preset["warmup"],
                     peers_python=peers_python, logdir=pathlib.Path(tmp), log=log)
      rows += r
      for name, why in s.items():
        skipped.setdefault(name, f"{workers} worker(s): {why}")
      for row in r:
        versions.setdefault(row["framework"], row.get("version"))
  result = {"rows": rows, "skipped": skipped, "versions": versions,
            "settings": {"rounds": preset["rounds"], "steps": preset["steps"],
                         "warmup": preset["warmup"]}}
  if args.json:
    print(json.dumps(result))
  else:
    print("\n".join(section(result)))
  return result


if __name__ == "__main__":
  main()
