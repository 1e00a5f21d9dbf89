"""Issue 12's targets, the throughput chart, and a step-time model.

Everything here reads peers.py's rows (with each round's seconds), so every
ratio is taken between blocks timed in the same round.

The step-time model: a step with K steps per dispatch on N replicas takes

    t_K(N) = compute / N + 2 (N - 1) / N * S / B + dispatch / K

(S: the gradient's bytes, B: the all-reduce bandwidth, dispatch: the host's
cost per call). jdist's one-step and 32-step loops give, per N, the dispatch
cost and the per-step device time c(N) = compute / N + 2 (N - 1) / N * S / B;
the model is fitted on N = 1 and 2 and predicts N = 4, which is then compared
with the measurement.
"""

from __future__ import annotations

import pathlib
import statistics

# Gradient bytes of the seed models (float32 parameters).
PARAM_BYTES = {
    "mlp": 4 * (10 * 16 + 16 + 16 * 10 + 10),
    "cnn": 4 * (9 * 32 + 32 + 9 * 32 * 64 + 64 + 28 * 28 * 64 * 64 + 64 +
                64 * 10 + 10),
}

# (numerator framework, denominator framework, model, target, what)
TARGETS = [
    ("jdist_fit_spe", "keras_jax_spe", "mlp", {2: 1.2},
     "Trainer fit, steps_per_execution=32 / Keras 3 fit, steps_per_execution=32"),
    ("jdist_multi", "jdist", "mlp", {1: 1.3, 2: 1.3, 4: 1.3},
     "custom loop, multi_step over 32 / jdist one step per dispatch"),
    ("jdist", "jax_hand", "mlp", {1: 0.9, 2: 0.9, 4: 0.9},
     "jdist, host batch every step / hand-written JAX"),
    ("jdist", "jax_hand", "cnn", {1: 0.97, 2: 0.97, 4: 0.97},
     "jdist CNN / hand-written JAX"),
]


def _seconds(rows, framework, model, replicas):
  for r in rows:
    if (r["framework"], r["model"], r["replicas"]) == (framework, model,
                                                       replicas):
      return r
  return None


def pair_ratio(rows, num, den, model, replicas):
  """Median and spread over rounds of num's speed / den's speed."""
  a, b = _seconds(rows, num, model, replicas), _seconds(rows, den, model,
                                                         replicas)
  if not a or not b or len(a["seconds"]) != len(b["seconds"]):
    return None
  ratios = [tb / ta for ta, tb in zip(a["seconds"], b["seconds"])]
  return statistics.median(ratios), min(ratios), max(ratios)


def targets_section(rows: list) -> list:
  lines = ["## Issue 12's targets (ratios of speeds in the same rounds)", "",
           "| ratio | replicas | median | spread | target | met |",
           "|---|---|---|---|---|---|"]
  for num, den, model, targets, what in TARGETS:
    for n in sorted({r["replicas"] for r in rows}):
      got = pair_ratio(rows, num, den, model, n)
      if got is None:
        continue
      target = targets.get(n)
      met = "" if target is None else ("yes" if got[0] >= target else "**no**")
      lines.append(f"| {what} ({model}) | {n} | **{got[0]:.2f}** | "
                   f"{got[1]:.2f} to {got[2]:.2f} | "
                   f"{'' if target is None else f'>= {target}'} | {met} |")
  return lines


def chart(rows: list, path: pathlib.Path) -> list:
  """Draws samples/s by framework and replica count; the lines linking it."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return ["(No chart: matplotlib is not installed; `pip install "
            "jdist[bench]`.)"]
  models = list(dict.fromkeys(r["model"] for r in rows))
  fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5),
                           squeeze=False)
  for ax, model in zip(axes[0], models):
    mrows = [r for r in rows if r["model"] == model]
    frameworks = list(dict.fromkeys(r["label"] for r in mrows))
    replicas = sorted({r["replicas"] for r in mrows})
    width = 0.8 / max(1, len(frameworks))
    for i, label in enumerate(frameworks):
      xs, ys = [], []
      for j, n in enumerate(replicas):
        for r in mrows:
          if r["label"] == label and r["replicas"] == n:
            xs.append(j + i * width)
            ys.append(r["samples_per_s"])
      ax.bar(xs, ys, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(replicas))])
    ax.set_xticklabels([f"{n} replica{'s' if n > 1 else ''}" for n in replicas])
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (log)")
    ax.set_title({"mlp": "seed MLP, global batch 256",
                  "cnn": "seed CNN, global batch 64"}.get(model, model))
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return [f"![samples/s by framework and replica count]({path.name})"]


def _times(rows, model):
  """{N: (one-step seconds per step, 32-step seconds per step)}."""
  out = {}
  for n in sorted({r["replicas"] for r in rows}):
    one = _seconds(rows, "jdist", model, n)
    multi = _seconds(rows, "jdist_multi", model, n)
    if one and multi:
      per = lambda r: statistics.median(r["seconds"]) / r["steps_per_block"]
      # A block shorter than 32 steps is one group of its length.
      out[n] = (per(one), per(multi), min(32, multi["steps_per_block"]))
  return out


def fit(times: dict):
  """Dispatch cost and device time per step c(N), from t_1 and t_k."""
  out = {}
  for n, (t1, tk, k) in times.items():
    dispatch = (t1 - tk) * k / (k - 1)
    out[n] = (dispatch, tk - dispatch / k)
  return out


def model_section(rows: list) -> list:
  lines = ["## A step-time model, and what it says for GPUs and TPUs", "",
           "t_K(N) = compute/N + 2(N-1)/N * S/B + dispatch/K, per step, with K "
           "steps per dispatch on N replicas (S: gradient bytes, B: all-reduce "
           "bandwidth). From jdist's one-step and 32-step loops (same rounds): "
           "dispatch = (t_1 - t_32) * 32/31, device time c(N) = t_32 - "
           "dispatch/32. compute and S/B are fitted on N = 1 and 2; N = 4 is "
           "predicted and compared with the measurement.", ""]
  # The MLP only: the CNN's step is compute-bound here (and RESULTS.md's CNN
  # rows of multi_step predate its convolutions' fast layout inside loops on
  # XLA:CPU, `core/conv_layout.py`: the scan then ran them ~30x slower).
  for model in ("mlp",):
    times = _times(rows, model)
    if not {1, 2} <= set(times):
      continue
    parts = fit(times)
    compute = parts[1][1]
    s_over_b = parts[2][1] - compute / 2
    lines += [f"### {model.upper()} (S = {PARAM_BYTES[model]:,} bytes)", "",
              "| replicas | t_1 (us) | t_32 (us) | dispatch (us) | device c(N) "
              "(us) | model c(N) (us) | model t_1 (us) |",
              "|---|---|---|---|---|---|---|"]
    dispatch_mean = statistics.mean(d for d, _ in parts.values())
    for n, (t1, tk, _) in times.items():
      predicted = compute / n + 2 * (n - 1) / n * s_over_b
      lines.append(
          f"| {n} | {t1 * 1e6:.1f} | {tk * 1e6:.1f} | {parts[n][0] * 1e6:.1f} "
          f"| {parts[n][1] * 1e6:.1f} | {predicted * 1e6:.1f} | "
          f"{(predicted + dispatch_mean) * 1e6:.1f} |")
    if 4 in times:
      predicted = compute / 4 + 1.5 * s_over_b
      err = (predicted - parts[4][1]) / parts[4][1]
      lines += ["", f"Fitted: compute {compute * 1e6:.1f} us, S/B "
                f"{s_over_b * 1e6:.1f} us (B = {PARAM_BYTES[model] / max(s_over_b, 1e-12) / 1e9:.3g} GB/s "
                f"effective). At 4 replicas the model predicts a device time "
                f"of {predicted * 1e6:.1f} us against {parts[4][1] * 1e6:.1f} "
                f"us measured ({err:+.0%})."]
    lines.append("")
  lines += _accelerators()
  return lines


def _accelerators() -> list:
  return [
      "### On GPUs and TPUs (from the model, not measured here)", "",
      "Fake CPU devices share two cores, so compute/N does not shrink past two "
      "replicas and the \"all-reduce\" is a memory copy; what carries over is "
      "the dispatch term. On an accelerator, compute/N does shrink, and the "
      "host's cost per call (Python, argument handling, launch: tens of "
      "microseconds) stays: for a step of a few hundred microseconds or less "
      "it is a large share of the time, which is why Keras makes "
      "steps_per_execution a compile argument and why TPUs want it. With "
      "K = 32 that share falls 32-fold and the loop runs at the devices' "
      "pace. The all-reduce term 2(N-1)/N * S/B is the same with or without "
      "K: for the seed MLP (1.4 KB of gradients) it is latency, a few "
      "microseconds on NVLink or ICI; for the seed CNN (12.9 MB) about 0.2 ms "
      "at N = 4 over 100 GB/s links, where a mesh that follows the physical "
      "ring (issue 12's device order) keeps B at the links' speed. Input "
      "placed ahead of the step (InputOptions) hides the host-to-device copy "
      "behind the previous step, which matters more on accelerators, where "
      "the copy crosses PCIe, than on CPU, where it is a memcpy."]
