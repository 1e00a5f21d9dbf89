"""`make bench`: runs the benchmarks and writes benchmarks/RESULTS.md.

Every figure is a ratio measured within one run (jdist against the
hand-written step, and against its peers, interleaved), because these machines
are shared and noisy; absolute steps or samples per second are printed for
context only. The fault sections (fault_times.py, elastic_times.py) are times,
seconds to a clean error or to training again, under the load the header
states; the docs' fault tables quote them.

  python benchmarks/run.py [--quick] [--peers-python .venv-peers/bin/python]
      [--frameworks jdist,jax_hand,...] [--models mlp] [--replicas 1,2]

It also draws benchmarks/throughput.png (samples/s by framework and replica
count; needs matplotlib, the `bench` extra) and checks a step-time model
against the measurements (benchmarks/step_model.py). The sections of
RESULTS.md it does not write (a script run apart, its section pasted in)
stay, after the ones it wrote (`kept_sections`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys


HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import checkpoint_saves  # noqa: E402  (its RESULTS.md section)
import elastic_times  # noqa: E402  (its RESULTS.md section)
import fault_times  # noqa: E402  (its RESULTS.md section)
import fit_overhead  # noqa: E402  (its RESULTS.md section)
import keras_models  # noqa: E402  (its RESULTS.md section)
import model_parallel  # noqa: E402  (its RESULTS.md section)
import pipelines  # noqa: E402  (its RESULTS.md section)
import provenance  # noqa: E402  (a launched run's provenance)
import ps  # noqa: E402  (its RESULTS.md section)
import step_model  # noqa: E402  (issue 12's sections)


def _output(command: list, env: dict, what: str, timeout: float) -> str:
  """`command`'s standard output. Progress goes to stderr, which is shown as
  it comes. On a timeout the child gets SIGTERM (a launcher then stops its
  ranks, a benchmark its workers), then SIGKILL."""
  proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
  try:
    out, _ = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:  # timed out or interrupted: let it stop its workers
      proc.terminate()
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
  if proc.returncode:
    raise RuntimeError(f"{what} failed with code {proc.returncode} (see above)")
  return out


def _run(script: str, devices: int, *args: str, timeout: float = 3600,
         env: dict | None = None) -> list:
  """`script` on `devices` fake CPU devices; its last line of stdout as JSON."""
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             **(env or {}))
  out = _output([sys.executable, str(HERE / script), "--json", *args], env,
                script, timeout)
  return json.loads(out.strip().splitlines()[-1])


def _run_launched(script: str, processes: int, devices: int, *args: str,
                  timeout: float = 1800) -> dict:
  """`script` under `jdist launch` (`processes` x `devices`), its process
  0's last line of output read as JSON (the launcher prefixes each line with
  its rank), with the run's provenance."""
  command = [sys.executable, "-m", "jdist.launch", "-n", str(processes),
             "--devices-per-process", str(devices), str(HERE / script),
             "--json", *args]
  st = provenance.stamp()
  st["command"] = (f"python -m jdist.launch -n {processes} "
                   f"--devices-per-process {devices} benchmarks/{script}"
                   + "".join(f" {a}" for a in args))
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  env.pop("XLA_FLAGS", None)  # the launcher sets each process's devices
  out = _output(command, env, script, timeout)
  last = [l for l in out.splitlines() if l.startswith("[0] {")][-1]
  return {**json.loads(last[len("[0] "):]), "provenance": provenance.finish(st)}


def _load() -> str:
  return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description="Runs the benchmarks, writes RESULTS.md.")
  parser.add_argument("--quick", action="store_true", help="a fast smoke run")
  parser.add_argument("--peers-python", default=None,
                      help="the peers' venv python (default .venv-peers/bin/python)")
  parser.add_argument("--no-peers", action="store_true", help="the overhead section only")
  parser.add_argument("--frameworks", help="peers.py's --frameworks (a subset)")
  parser.add_argument("--models", help="peers.py's --models, e.g. mlp")
  parser.add_argument("--replicas", help="peers.py's --replicas, e.g. 1,2,4")
  parser.add_argument("--rounds", help="peers.py's --rounds")
  parser.add_argument("--no-ps", action="store_true",
                      help="leave out the parameter-server comparison (ps.py)")
  parser.add_argument("--no-faults", action="store_true",
                      help="leave out fault_times.py and elastic_times.py "
                           "(several minutes)")
  parser.add_argument("--tpu-plugin", default=str(HERE.parent / ".tpu-plugin"),
                      help="a directory holding libtpu (pip install --target), "
                           "for mixed_precision.py's deviceless TPU compile")
  args = parser.parse_args(argv)
  extra = ("--quick",) if args.quick else ()
  import jax
  load_before = _load()
  overhead = _run("overhead.py", 4, *extra)
  per_call = None if args.quick else _run(
      "overhead.py", 4, "--instructions", str(PER_CALL_CALLS), "--devices",
      PER_CALL_DEVICES)
  peers_result = ps_result = None
  if not args.no_peers:
    peer_args = extra + (("--peers-python", args.peers_python) if args.peers_python else ())
    subset = ()
    for name in ("frameworks", "models", "replicas", "rounds"):
      if getattr(args, name):
        subset += (f"--{name}", getattr(args, name))
    try:
      peers_result = _run("peers.py", 1, *peer_args, *subset, timeout=2400)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
      peers_result = {"error": str(e)}
    try:
      if not args.no_ps:
        ps_result = _run("ps.py", 1, *peer_args, timeout=1800)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
      ps_result = {"error": str(e)}
  load_after = _load()
  lines = [
      "# Benchmarks",
      "",
      f"Written by `make bench` on {datetime.date.today()} "
      f"({platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
      f"Python {platform.python_version()}). Fake CPU devices share the cores.",
      f"Load average (1, 5, 15 min) before the run: {load_before}; after: "
      f"{load_after}." + (" A `--quick` smoke run: too short to quote." if args.quick else ""),
      "",
      *overhead_section(overhead, per_call),
  ]
  lines += [""] + zero_section(_run("zero_memory.py", 4, *extra))
  lines += [""] + model_parallel.section(_run(
      "model_parallel.py", 4, *extra,
      *(("--no-peers",) if args.no_peers else
        ("--peers-python", args.peers_python) if args.peers_python else ())))
  lines += [""] + pipelines.section(_run("pipelines.py", 8, *extra))
  plugin = pathlib.Path(args.tpu_plugin)
  lines += [""] + mixed_precision_section(_run(
      "mixed_precision.py", 2, *extra,
      env={"PYTHONPATH": os.pathsep.join(filter(None, [
          str(plugin), os.environ.get("PYTHONPATH")]))}
      if (plugin / "libtpu").is_dir() else {}))
  if peers_result is not None:
    lines += [""] + peers_section(peers_result)
    if "rows" in peers_result:
      lines += [""] + step_model.targets_section(peers_result["rows"])
      lines += [""] + step_model.chart(peers_result["rows"],
                                       HERE / "throughput.png")
      lines += [""] + step_model.model_section(peers_result["rows"])
  if ps_result is not None:
    lines += [""] + ps.section(ps_result)
  lines += [""] + fit_overhead.section(_run("fit_overhead.py", 4, *extra))
  lines += [""] + checkpoint_saves.section(_run(
      "checkpoint_saves.py", checkpoint_saves.DEVICES, *extra))
  try:
    keras_result = _run("keras_models.py", 2, *extra, timeout=2400)
  except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
    keras_result = {"error": str(e)}
  lines += [""] + keras_models.section(keras_result)
  try:
    multihost = _run_launched("multihost_overhead.py", 2, 2, *extra)
  except (RuntimeError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
    multihost = {"error": str(e)}
  lines += [""] + multihost_section(multihost)
  if not args.no_faults:
    lines += [""] + fault_times.section(_run(
        "fault_times.py", 4, *(FAULT_TRIALS_QUICK if args.quick else FAULT_TRIALS)))
    lines += [""] + elastic_times.section(_run(
        "elastic_times.py", 1, *(ELASTIC_QUICK if args.quick else FAULT_TRIALS)))
  out = HERE / "RESULTS.md"
  kept = kept_sections(out.read_text() if out.exists() else "", lines)
  out.write_text("\n".join(lines + kept) + "\n")
  print("\n".join(lines + kept))
  print(f"\nwrote {out}")
  return 0


KEPT = ("The sections below were in RESULTS.md before this run and are not "
        "written by it: `make bench` keeps them as they were, with the "
        "commands and dates they give.")


def kept_sections(old: str, lines: list) -> list:
  r"""What to append to this run's RESULTS.md `lines`: the `## ` sections
  of the old text `old` whose headings the run does not write, in their
  order, after a line that says so; [] when there are none. They are
  measurements of scripts run apart, which a `make bench` must not lose
  (the docs point at some of them by name).

  Example:
    >>> old = "# Benchmarks\n\n## A\n\n1 s\n\n## B\n\n2 s\n"
    >>> kept_sections(old, ["# Benchmarks", "", "## A", "", "3 s"])[-3:]
    ['## B', '', '2 s']
  """
  old = old.replace(f"\n---\n\n{KEPT}\n", "\n")  # a run's before this
  written = {line for line in lines if line.startswith("## ")}
  kept, keep = [], False
  for line in old.split("\n"):
    if line.startswith(("## ", "# ")):
      keep = line.startswith("## ") and line not in written
    if keep:
      kept.append(line)
  while kept and not kept[-1]:
    kept.pop()
  return ["", "---", "", KEPT, "", *kept] if kept else []


PER_CALL_CALLS = 300  # calls counted by callgrind, per implementation
PER_CALL_DEVICES = "1,2,4"  # the device counts they are counted on
FAULT_TRIALS = ("--trials", "2")  # the docs quote the range of two
FAULT_TRIALS_QUICK = ("--case", "backup path is a file")
ELASTIC_QUICK = ("--case", "kill")
BEFORE = HERE / "overhead_before.json"  # the same figures for an earlier engine


def overhead_section(overhead: list, per_call: list | None) -> list:
  """The "per-step overhead" section of RESULTS.md (overhead.py)."""
  lines = [
      "## Per-step overhead: jdist vs the same step hand-written",
      "",
      "Hand-written: `jax.jit(jax.shard_map(...))` with mirrored parameters and the",
      "globally scaled loss. jdist: the per-replica function under",
      "`strategy.function`, batches from `experimental_distribute_dataset` (with",
      "their padding mask and valid count). Ratio = jdist steps/s / hand-written",
      "steps/s, the median over interleaved rounds (spread in brackets). Target:",
      "at least 0.98 for the MLP, 0.99 for the CNN.",
      "",
      "| model | devices | global batch | hand-written steps/s | jdist steps/s | ratio | spread |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in overhead:
    name = {"mlp": "MLP 10-16-10", "cnn": "CNN 28x28x1"}[r["model"]]
    lines.append(
        f"| {name} | {r['devices']} | {r['batch']} | {r['hand_steps_per_s']:.1f} "
        f"| {r['jdist_steps_per_s']:.1f} | **{r['ratio']:.3f}** | "
        f"{r['ratio_spread'][0]:.3f} to {r['ratio_spread'][1]:.3f} |")
  before = json.loads(BEFORE.read_text())
  now_mlp2 = next((r for r in overhead if (r["model"], r["devices"]) ==
                   ("mlp", 2)), None)
  lines += [
      "",
      "**Per call** (the MLP): what one step call costs the calling thread, "
      "hand-written and under jdist. Instructions: counted by valgrind's "
      f"callgrind over {(per_call or [{}])[0].get('calls', PER_CALL_CALLS)} "
      "calls, in the loop of calls only "
      "(repeatable on a shared machine), on each device count. "
      "Microseconds (2 devices): the calling thread's CPU time per step in "
      "the rounds above (noisy: the fake devices' threads share the cores). "
      f"Before: jdist at commit {before['commit']} ({before['engine']}), "
      "measured by this script with `JDIST_BENCH_SOURCE` "
      f"(`benchmarks/{BEFORE.name}`); now: this run.",
      "",
      "| per call | hand-written | jdist | jdist's extra |",
      "|---|---|---|---|",
  ]
  rows = []
  for label, found in ((f"before ({before['commit']})",
                        before["instructions"]), ("now", per_call)):
    for res in found or [None]:
      devices = f", {res['devices']} dev" if res else ""
      rows.append((f"instructions, {label}{devices}", res, "hand", "jdist",
                   "{:,.0f}"))
  rows += [(f"calling thread us, before ({before['commit']})", before["mlp_2"],
            "hand_thread_us", "jdist_thread_us", "{:.1f}"),
           ("calling thread us, now", now_mlp2, "hand_thread_us",
            "jdist_thread_us", "{:.1f}")]
  for label, res, hand, jd, fmt in rows:
    if not res:
      lines.append(f"| {label} | not measured (no valgrind, or --quick) | | |")
      continue
    extra = res[jd] - res[hand]
    lines.append(f"| {label} | {fmt.format(res[hand])} | {fmt.format(res[jd])} "
                 f"| {extra:+,.{1 if '.1f' in fmt else 0}f} "
                 f"({res[jd] / res[hand]:.2f}x) |")
  return lines


def _us(figure: dict) -> str:
  return f"{figure['median']:,.1f} ({figure['min']:,.1f})"


def multihost_section(res: dict) -> list:
  """The "multi-process overhead" section of RESULTS.md
  (multihost_overhead.py under `jdist launch`)."""
  lines = ["## Multi-process overhead: what jdist adds across processes", ""]
  if "error" in res:
    return lines + [f"Not measured: {res['error']}"]
  times = res["us_per_step"]
  hand, jd = times["hand-written jit+shard_map"], times["jdist step"]
  lines += [
      provenance.line(res["provenance"]),
      "",
      f"{res['where']}, MultiWorkerMirroredStrategy; a tiny MLP step (64 "
      "features, Dense 16, Dense 10, batch 64) against the same step "
      "hand-written with `jax.jit` + `shard_map` (the same throttle), "
      f"{res['steps']} steps a trial, {res['trials']} alternating trial(s): "
      "median (minimum) microseconds.",
      "",
      "| what | us |",
      "|---|---|",
  ]
  for name, figure in times.items():
    lines.append(f"| {name}, per step | {_us(figure)} |")
  lines.append(f"| jdist / hand-written speed (medians) | "
               f"**{res['jdist_vs_hand']:.3f}** |")
  off = times.get("jdist step, monitor off")
  if off is not None:
    lines.append(f"| the step monitor's bookkeeping, per step | "
                 f"{jd['median'] - off['median']:+,.1f} "
                 f"({jd['min'] - off['min']:+,.1f}) |")
  check = res.get("program_check_ms")
  lines.append(f"| first call (trace, program check, compile), ms | "
               f"{res['first_call_ms']:,.0f} |")
  if check:
    lines.append(f"| of which the program check, ms (printing the jaxpr) | "
                 f"{check['total']:.1f} ({check['jaxpr_text']:.1f}) |")
  exchange = res.get("exchange_us")
  if exchange:
    agreement = res["agreement_us_per_step"]
    w = str(exchange["window"])
    lines += [
        f"| one key-value exchange of the processes | {_us(exchange)} |",
        f"| input agreement per step at its window of {w} (window {w} "
        f"minus no agreement) | {agreement[w] - agreement['400']:+,.1f} |",
    ]
  glob = res.get("global_batches_us")
  if glob:
    extra = glob["with"]["median"] - glob["without"]["median"]
    lines.append(
        "| a global batch's fingerprint, per batch of "
        "experimental_distribute_dataset across the processes | "
        f"{extra:+,.1f} ({extra / glob['without']['median'] * 100:+.1f}% of "
        f"{glob['without']['median']:,.0f}) |")
  for name, figure in res["fingerprint_us"].items():
    lines.append(f"| the fingerprint alone: {name} | {_us(figure)} |")
  if not exchange:
    lines += ["", "One process: the cross-process rows (key-value exchange, "
              "input agreement, global batches) are not measured."]
  return lines


def zero_section(res: dict) -> list:
  """The "sharded optimizer state" section of RESULTS.md (zero_memory.py)."""
  modes = res["modes"]
  lines = [
      "## Sharded optimizer state (ZeRO): memory per device",
      "",
      f"An MLP 64-512-512-10 ({res['params']:,} parameters) with adam on "
      f"{res['devices']} replicas, the same 20 steps three ways: mirrored "
      "state (`optax.adam`), ZeRO-1 (`jdist.ShardedOptimizer`, gradients "
      "summed by autodiff, each replica takes its block) and ZeRO-2 (its "
      "`value_and_grad`: gradients reduce-scattered). State bytes: the "
      "optimizer state's arrays' addressable shards on one device. Step "
      "memory: the compiled step's memory analysis on one device, arguments "
      "+ outputs + temporaries (nothing donated). Collectives: "
      "counted in the compiled program. Speed: steps/s over mirrored's, the "
      "median of interleaved rounds; on CPU the collectives are memory "
      "copies, so only the ratio's direction means anything here.",
      "",
      "| state | opt. state bytes/device | vs mirrored | step memory/device "
      "(args + out + temp) | all-reduce / reduce-scatter / all-gather | "
      "max param diff after 20 steps | speed vs mirrored |",
      "|---|---|---|---|---|---|---|",
  ]
  names = {"mirrored": "mirrored", "zero1": "ZeRO-1", "zero2": "ZeRO-2"}
  for mode, r in modes.items():
    c = r["collectives"]
    lines.append(
        f"| {names[mode]} | {r['opt_state_bytes_per_device']:,} | "
        f"**{r['state_ratio']:.3f}** | {_step_memory(r)} | {c['all-reduce']} / "
        f"{c['reduce-scatter']} / {c['all-gather']} | "
        f"{r['max_param_diff']:.1e} (of {r['param_scale']:.2f}) | "
        f"{r['speed_ratio']:.2f} ({r['speed_spread'][0]:.2f} to "
        f"{r['speed_spread'][1]:.2f}) |")
  return lines


def mixed_precision_section(res: dict) -> list:
  """The "mixed precision" section of RESULTS.md (mixed_precision.py)."""
  names = ("float32", "mixed_bfloat16", "mixed_float16")
  mb = lambda b: f"{b / 2**20:.1f} MB"
  full, every = res["examples"]
  lines = [
      "## Mixed precision: loss curve, compiled memory, speed",
      "",
      "The seed CNN (Conv 32, Conv 64, Dense 64, Dense 10) on scikit-learn's "
      "digits, adam, float32 master weights and optimizer state, the model run "
      "in the policy's dtype; float16 with `jdist.loss_scale_optimizer`.",
      "",
      f"**Loss curve**: `jdist.Trainer(..., dtype_policy=...)`, 2 replicas, "
      f"batch 64, {res['epochs']} epochs from the same weights; the training "
      "loss per epoch and its largest relative difference from float32's.",
      "",
      f"| policy | loss per epoch ({full} examples: {full // 64} full "
      f"batches) | max rel. diff | loss per epoch (all {every}: a last batch "
      f"of {every - full}) | max rel. diff |",
      "|---|---|---|---|---|",
  ]
  for p in names:
    a, b = res["curves"][p], res["curves_all"][p]
    lines.append(
        f"| {p} | {' / '.join(f'{v:.4f}' for v in a['loss'])} | "
        f"{a['max_rel_diff']:.3f} | {' / '.join(f'{v:.4f}' for v in b['loss'])}"
        f" | {b['max_rel_diff']:.3f} |")
  lines += [
      "",
      f"A last batch of {every - full} examples takes a full-size adam step, "
      f"so the curve on all {every} examples jumps, and where it jumps depends on rounding: "
      "the right column differs between policies by more than the "
      "precision does on full batches (left). tests/test_mixed_precision.py "
      "allows 5% + 0.01.",
      "",
      f"**Memory and speed on CPU**: a custom-loop step (`strategy.function`) "
      f"on {res['cpu']['replicas']} replicas, its compiled memory analysis "
      "on one device: temporaries (activations, gradients, scratch) and the "
      "activations the backward pass keeps (`jax.vjp`'s residuals, per "
      "replica). Speed: steps/s over float32's, the median of interleaved "
      "rounds [min, max].",
      "",
      "| global batch | policy | temporaries | vs float32 | kept for backward "
      "| vs float32 | speed vs float32 |",
      "|---|---|---|---|---|---|---|",
  ]
  for batch, row in res["cpu"]["batches"].items():
    for p in names:
      r = row[p]
      lines.append(
          f"| {batch} | {p} | {mb(r['temp_bytes'])} | **{r['temp_ratio']:.2f}**"
          f" | {mb(r['residual_bytes'])} | **{r['residual_ratio']:.2f}** | "
          f"{r['speed_ratio']:.2f} [{r['speed_spread'][0]:.2f}, "
          f"{r['speed_spread'][1]:.2f}] |")
  lines += [
      "",
      "XLA's CPU backend has no fast low-precision path: it converts "
      "bfloat16 and float16 matrix products and convolutions to float32 "
      "(float16 adds conversion buffers, so its temporaries grow), and the "
      "speed stays that of float32. What low precision saves on CPU is the "
      "activations kept for the backward pass (about half).",
      "",
  ]
  tpu = res.get("tpu", {})
  if "error" in tpu:
    lines += ["**TPU**: not measured (libtpu could not be imported: "
              f"{tpu['error']}; `make bench` installs it into `.tpu-plugin`)."]
    return lines
  lines += [
      f"**Memory on TPU** ({tpu['device']}, compiled ahead of time without a "
      "TPU by JAX's deviceless compilation, libtpu): the same per-replica "
      "step body for one chip; a data-parallel step adds only the gradient "
      "all-reduce to this program. Temporaries in the chip's HBM (at smaller "
      "batches they fit in on-chip memory and read 0).",
      "",
      "| batch per chip | policy | temporaries | vs float32 |",
      "|---|---|---|---|",
  ]
  for batch, row in tpu["batches"].items():
    for p in names:
      r = row[p]
      ratio = "n/a" if r["temp_ratio"] is None else f"**{r['temp_ratio']:.2f}**"
      lines.append(f"| {batch} | {p} | {mb(r['temp_bytes'])} | {ratio} |")
  lines += [
      "",
      "Speed on GPU/TPU is not measured here (no accelerator). On paper: "
      "the matrix units of TPUs and of GPUs since Volta run bfloat16/float16 "
      "at several times their float32 rate (NVIDIA and Keras quote up to 3x "
      "for mixed precision on GPUs), and a step that is memory-bound gains "
      "with the bytes halved; a step dominated by the optimizer update, "
      "collectives or input gains little, since those stay float32.",
  ]
  return lines


def _step_memory(r: dict) -> str:
  parts = [r.get(k) for k in ("argument_bytes", "output_bytes", "temp_bytes")]
  if any(p is None for p in parts):
    return "n/a"
  return f"{sum(parts):,} ({' + '.join(f'{p:,}' for p in parts)})"


PEER_NOTES = {
    "jdist_multi": "the same custom loop with `jdist.multi_step(step)` over "
                   "`experimental_distribute_dataset(block).group(32)`: 32 steps "
                   "per dispatch, the block's batches stacked 32 at a time",
    "jdist_fit_spe": "`jdist.Trainer(..., steps_per_execution=32).fit` on numpy "
                     "arrays, one epoch per block, as the Keras rows",
    "jax_hand": "not a peer but the floor: the same step as `jit(shard_map)` "
                "with one `device_put` per batch; the gap to jdist is jdist's own cost",
    "keras_jax": "`model.fit` on numpy arrays (the fast path; `train_on_batch` "
                 "returns a float and so waits for every step), one epoch per block",
    "keras_jax_spe": "the same with `steps_per_execution=32`, Keras's knob for "
                     "small models (fewer callbacks; still one jitted call per step)",
    "tf_mirrored": "the tutorial's custom loop: `tf.function` of `strategy.run` "
                   "called once per step, distributed `tf.data`, Keras layers and SGD",
    "torch_ddp": "N processes x 1 thread, gloo on 127.0.0.1, ready per-rank tensors "
                 "(no DataLoader); at 1 replica it uses one core where TensorFlow "
                 "uses both (XLA's CPU convolutions use about one core either way)",
    "accelerate": "`Accelerator(cpu=True)` over the same N processes; "
                  "`prepare(model, optimizer)`, `accelerator.backward`",
}


def peers_section(res: dict) -> list:
  """The "vs peers" section of RESULTS.md from peers.py's JSON."""
  if "error" in res:
    return ["## vs peers", "", f"The peer comparison failed: {res['error']}"]
  st = res["settings"]
  rows = res["rows"]
  lines = [
      "## vs peers: the same training in other frameworks",
      "",
      "Every framework trains the seed models from the same initial weights on the",
      "same synthetic batches (fixed seed; 4 global batches cycled), with SGD and",
      "softmax cross-entropy: the MLP (Dense 16, Dense 10 on 10 features) at global",
      "batch 256 and the CNN (Conv 32, Conv 64, Dense 64, Dense 10 on 28x28x1) at",
      "global batch 64. Each framework runs in its own long-lived process(es),",
      f"started and warmed up ({st['warmup']} steps) before timing; then each of",
      f"{st['rounds']} rounds times one block of {_steps(st['steps'])} steps per framework",
      "and model, the frameworks' order rotating from round to round so that noise",
      "hits all alike. samples/s is the median over rounds, [min, max] beside it;",
      "**jdist / peer** is the median over rounds of jdist's speed divided by the",
      "peer's in the same round (above 1: jdist is faster), [min, max] beside it.",
      "Fake CPU devices (JAX), logical CPU devices (TF) and processes (torch) all",
      "share the machine's cores.",
      "",
      "jdist: `MirroredStrategy` and a custom loop under `strategy.function`, batches",
      "from `experimental_distribute_dataset` (each host batch placed every step, as",
      "in a user's loop; the overhead section above feeds one pre-placed batch).",
  ]
  for name, note in PEER_NOTES.items():
    if any(r["framework"] == name for r in rows):
      label = next(r["label"] for r in rows if r["framework"] == name)
      lines.append(f"- {label}: {note}.")
  lines.append("")
  for model in dict.fromkeys(r["model"] for r in rows):
    mrows = [r for r in rows if r["model"] == model]
    r0 = mrows[0]
    title = {"mlp": "MLP 10-16-10", "cnn": "CNN 28x28x1"}.get(model, model)
    lines += [f"### {title}, global batch {r0['batch']}", "",
              "| replicas | framework | samples/s | spread | jdist / peer | spread "
              f"| loss after {_total(st, model)} steps |",
              "|---|---|---|---|---|---|---|"]
    for r in mrows:
      sp = r.get("jdist_speedup")
      name = f"**{r['label']}**" if r["framework"] == "jdist" else r["label"]
      ratio = "1" if r["framework"] == "jdist" else (f"**{sp:.2f}**" if sp else "n/a")
      rspread = ("" if r["framework"] == "jdist" or not sp else
                 f"{r['jdist_speedup_spread'][0]:.2f} to {r['jdist_speedup_spread'][1]:.2f}")
      lo, hi = r["samples_per_s_spread"]
      lines.append(f"| {r['replicas']} | {name} | {r['samples_per_s']:,.0f} | "
                   f"{lo:,.0f} to {hi:,.0f} | {ratio} | {rspread} | {r['loss']:.5f} |")
    faster = [f"{r['label']} at {r['replicas']} ({1 / r['jdist_speedup']:.2f}x jdist)"
              for r in mrows if r.get("jdist_speedup") and r["jdist_speedup"] < 1
              and not r["framework"].startswith("jdist")]
    lines += ["", "Faster than jdist here (median): " + ("; ".join(faster) or "none") + "."]
    loss0 = r0.get("loss0")
    spread = _loss_spread(mrows)
    lines += ["", f"Loss on the first global batch: {loss0:.5f} before training; after "
              f"training, the largest relative difference to jdist's is {spread:.1e}"
              + (" (all trained the same model)." if not res["loss_mismatch"] else
                 f". MISMATCH: {res['loss_mismatch']}."), ""]
  if res["skipped"]:
    lines += ["Left out:", ""]
    for name, why in res["skipped"].items():
      lines.append(f"- {name}: {why}")
    lines.append("")
  versions = ", ".join(dict.fromkeys(v for v in res["versions"].values() if v))
  lines.append(f"Versions: {versions}.")
  return lines


def _steps(steps: dict) -> str:
  return ", ".join(f"{v} ({k})" for k, v in steps.items())


def _total(settings: dict, model: str) -> int:
  warm = dict(kv.split(":") for kv in settings["warmup"].split(","))
  return int(warm.get(model, 1)) + settings["rounds"] * settings["steps"][model]


def _loss_spread(rows: list) -> float:
  ref = {r["replicas"]: r["loss"] for r in rows if r["framework"] == "jdist"}
  diffs = [abs(r["loss"] - ref[r["replicas"]]) / abs(ref[r["replicas"]])
           for r in rows if r["replicas"] in ref and r["loss"] is not None]
  return max(diffs, default=0.0)


if __name__ == "__main__":
  sys.exit(main())
