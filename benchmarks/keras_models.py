"""Keras models in jdist: a Keras model trained by `jdist.Trainer`, against
Keras's own `fit` with `keras.distribution.DataParallel`, and against the
same model written in flax through `jdist.Trainer`.

The three train the same model (peers.py's MLP 10-16-10 and CNN, the common
initial weights) on the same batches with SGD, each in a worker process of
its own (peers.py's workers and protocol: `jdist_keras.py`, `keras_jax.py`,
`jdist_fit.py`), on the same replicas, in jdist's environment (the same jax
and keras for all three). Each round runs one block of steps per worker,
their order rotating; reported are samples/s (median over rounds) and the
speed ratios (the median of the per-round ratios, with min and max), and
the final losses, which must agree.

  python benchmarks/keras_models.py --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import statistics
import sys
import tempfile

import peers

FRAMEWORKS = ["jdist_keras", "keras_jax_here", "jdist_fit"]
# Targets: the Keras model in jdist against each other way of training it.
TARGETS = {"keras_jax_here": 1.5, "jdist_fit": 0.95}
FULL = {"replicas": 2, "rounds": 5, "steps": "mlp:512,cnn:10",
        "warmup": "mlp:64,cnn:4", "models": "mlp,cnn"}
QUICK = {"replicas": 2, "rounds": 2, "steps": "mlp:64,cnn:2",
         "warmup": "mlp:8,cnn:1", "models": "mlp"}


def ratios(rows: list) -> list:
  """Per model: the Keras model in jdist's speed over each other row's."""
  out = []
  for model in sorted({r["model"] for r in rows}):
    by = {r["framework"]: r for r in rows if r["model"] == model}
    ours = by.get("jdist_keras")
    for other in TARGETS:
      if ours is None or other not in by:
        continue
      per_round = [o / j for j, o in zip(ours["seconds"], by[other]["seconds"])]
      out.append({"model": model, "against": other,
                  "label": by[other]["label"],
                  "ratio": statistics.median(per_round),
                  "spread": [min(per_round), max(per_round)],
                  "target": TARGETS[other]})
  return out


def measure(*, replicas: int, rounds: int, steps: dict, warmup: str,
            models: list, log=print) -> dict:
  with tempfile.TemporaryDirectory(prefix="jdist-keras-bench-") as tmp:
    rows, skipped, info = peers.compare(
        replicas, FRAMEWORKS, models, rounds=rounds, steps=steps,
        warmup=warmup, peers_python=sys.executable, logdir=pathlib.Path(tmp),
        log=log)
  losses = {(r["model"], r["framework"]): r["loss"] for r in rows}
  mismatch = [(m, f) for (m, f), loss in losses.items()
              if abs(loss - losses.get((m, "jdist_keras"), loss)) >
              1e-3 * max(1.0, abs(loss))]
  return {"rows": rows, "ratios": ratios(rows), "skipped": skipped,
          "versions": {k: v.get("version") for k, v in info.items()},
          "loss_mismatch": mismatch,
          "settings": {"replicas": replicas, "rounds": rounds,
                       "steps": steps, "warmup": warmup}}


def section(res: dict) -> list:
  """The "Keras models" section of RESULTS.md."""
  lines = ["## Keras models in jdist.Trainer (benchmarks/keras_models.py)", ""]
  if "error" in res:
    return lines + [f"Not measured: {res['error']}"]
  s = res["settings"]
  lines += [
      f"One Keras model (peers.py's, from the common initial weights) on "
      f"{s['replicas']} fake CPU devices, the same batches and SGD: trained by "
      "`jdist.Trainer(keras_model)`, by Keras's own `fit` under "
      "`keras.distribution.DataParallel`, and written in flax and trained by "
      f"`jdist.Trainer`. {s['rounds']} rounds of "
      f"{', '.join(f'{m} {n}' for m, n in s['steps'].items())} steps per block "
      "(one `fit` epoch each), the workers' order rotating; samples/s is the "
      "median over rounds, a ratio the median of the per-round ratios "
      "[min, max]. Same jax and keras for all three. The MLP's step is "
      "overhead (what the targets are about); the CNN's is its "
      "convolutions, the same XLA program whichever way it is called.",
      "",
      "| model | trained by | samples/s | final loss |",
      "|---|---|---:|---:|"]
  for r in res["rows"]:
    lines.append(f"| {peers.MODEL_LABELS[r['model']]} | {r['label']} | "
                 f"{r['samples_per_s']:,.0f} | {r['loss']:.5f} |")
  lines += ["", "| model | Keras model in jdist.Trainer vs | speed ratio | "
            "target |", "|---|---|---:|---:|"]
  for q in res["ratios"]:
    lo, hi = q["spread"]
    met = "met" if q["ratio"] >= q["target"] else "**not met**"
    lines.append(f"| {peers.MODEL_LABELS[q['model']]} | {q['label']} | "
                 f"**{q['ratio']:.2f}** [{lo:.2f}, {hi:.2f}] | >= "
                 f"{q['target']} ({met}) |")
  for name, why in res["skipped"].items():
    lines.append(f"\nLeft out {name}: {why}")
  if res["loss_mismatch"]:
    lines.append(f"\nFinal losses disagree: {res['loss_mismatch']}")
  return lines


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a fast smoke run")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line at the end")
  parser.add_argument("--rounds", type=int)
  parser.add_argument("--steps", help="e.g. mlp:512,cnn:10")
  parser.add_argument("--models", help="e.g. mlp")
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else FULL
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  log = (lambda *a: print(*a, file=sys.stderr, flush=True))
  res = measure(replicas=preset["replicas"], rounds=args.rounds or
                preset["rounds"], steps=peers._parse_map(
                    args.steps or preset["steps"]),
                warmup=preset["warmup"], models=(args.models or
                                                 preset["models"]).split(","),
                log=log)
  if args.json:
    print(json.dumps(res))
  else:
    print("\n".join(section(res)))
  return res


if __name__ == "__main__":
  main()
