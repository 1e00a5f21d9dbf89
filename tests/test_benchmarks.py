"""The benchmark scripts still run (not how fast: timed tests are banned).

Tiny step counts, one round: these keep the scripts behind RESULTS.md and
the docs' figures from rotting, and check that what they print is what they
measured. The peers' part needs the venv that
`make bench` builds (.venv-peers, or PEERS_PYTHON) and is skipped without it.
"""

import importlib
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import jax
import pytest

from conftest import xla_flags

REPO = pathlib.Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
PEERS_PYTHON = pathlib.Path(os.environ.get(
    "PEERS_PYTHON", REPO / ".venv-peers" / "bin" / "python"))
TINY = ["--quick", "--json", "--replicas", "2", "--rounds", "1",
        "--steps", "mlp:3,cnn:1", "--warmup", "mlp:1,cnn:1"]


def _run(args, *, devices=2, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
             XLA_FLAGS=xla_flags(devices))
  proc = subprocess.Popen([sys.executable, *map(str, args)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:  # SIGTERM first: peers.py then stops its workers
      proc.send_signal(signal.SIGTERM)
      try:
        proc.communicate(timeout=60)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
  assert proc.returncode == 0, err[-3000:]
  return json.loads(out.strip().splitlines()[-1])


def _bench_module(name):
  sys.path.insert(0, str(BENCH))
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(str(BENCH))


@pytest.mark.multiprocess
def test_overhead_runs():
  results = _run([BENCH / "overhead.py", "--quick", "--json", "--devices", "2",
                  "--steps", "2", "--rounds", "1"])
  assert {(r["model"], r["devices"]) for r in results} == {("mlp", 2), ("cnn", 2)}
  for r in results:  # one round: the ratio is the two speeds' ratio
    assert r["ratio"] == pytest.approx(
        r["jdist_steps_per_s"] / r["hand_steps_per_s"], rel=1e-9), r
    assert r["ratio_spread"] == [r["ratio"], r["ratio"]], r


@pytest.mark.multiprocess
def test_peers_jdist_part_runs():
  res = _run([BENCH / "peers.py", *TINY, "--frameworks", "jdist,jax_hand"])
  assert not res["skipped"], res["skipped"]
  got = {(r["model"], r["replicas"], r["framework"]) for r in res["rows"]}
  assert got == {(m, 2, f) for m in ("mlp", "cnn") for f in ("jdist", "jax_hand")}
  # The hand-written step trains the same model: same loss after the same steps.
  assert not res["loss_mismatch"], res["loss_mismatch"]
  by = {(r["model"], r["framework"]): r for r in res["rows"]}
  for (model, framework), r in by.items():
    assert r["samples_per_s"] == pytest.approx(
        r["steps_per_block"] * r["batch"] / r["seconds"][0], rel=1e-9), r
    # jdist's speed over the peer's: the peer's time over jdist's.
    assert r["jdist_speedup"] == pytest.approx(
        r["seconds"][0] / by[model, "jdist"]["seconds"][0], rel=1e-9), r
  # RESULTS.md's section shows these measured rows, not other numbers.
  text = "\n".join(_bench_module("run").peers_section(res))
  for r in res["rows"]:
    label = f"**{r['label']}**" if r["framework"] == "jdist" else r["label"]
    assert (f"| 2 | {label} | {r['samples_per_s']:,.0f} |" in text), (r, text)
  assert f"{by['mlp', 'jax_hand']['jdist_speedup']:.2f}" in text


@pytest.mark.multiprocess
def test_parameter_server_jdist_part_runs():
  res = _run([BENCH / "ps.py", "--quick", "--json", "--frameworks", "jdist"])
  assert not res["skipped"], res["skipped"]
  (row,) = res["rows"]
  assert (row["workers"], row["framework"]) == (2, "jdist")
  assert row["loss"] < row["loss0"]
  lo, hi = row["spread"]
  assert lo <= row["examples_per_s"] <= hi, row
  text = "\n".join(_bench_module("ps").section(res))
  assert f"| 2 | {row['label']} | {row['examples_per_s']:,.0f} |" in text, text


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not PEERS_PYTHON.exists(),
                    reason=f"no peers' venv at {PEERS_PYTHON} (`make bench` builds it)")
def test_peers_run():
  res = _run([BENCH / "peers.py", *TINY,
              "--frameworks", "jdist,keras_jax,tf_mirrored,torch_ddp,accelerate",
              "--peers-python", PEERS_PYTHON], timeout=400)
  assert not res["skipped"], res["skipped"]
  assert len(res["rows"]) == 2 * 5
  assert not res["loss_mismatch"], res["loss_mismatch"]


@pytest.mark.multiprocess
def test_keras_models_runs():
  """A Keras model in the Trainer, Keras's own fit and the flax model train
  alike (their final losses agree) and the section prints the figures."""
  res = _run([BENCH / "keras_models.py", "--quick", "--json", "--rounds", "1",
              "--steps", "mlp:3"], timeout=400)
  assert not res["skipped"], res["skipped"]
  assert [r["framework"] for r in res["rows"]] == [
      "jdist_keras", "keras_jax_here", "jdist_fit"]
  assert not res["loss_mismatch"], res["loss_mismatch"]
  text = "\n".join(_bench_module("keras_models").section(res))
  for q in res["ratios"]:
    assert f"**{q['ratio']:.2f}**" in text, text
  ours = res["rows"][0]
  assert f"{ours['samples_per_s']:,.0f}" in text


def test_issue_12_sections_render(tmp_path):
  """The targets, the chart and the step-time model read peers.py's rows.
  The rows are built from chosen per-step times so that every figure the
  sections compute (ratios, the dispatch cost) is known by hand."""
  step_model = _bench_module("step_model")
  rows = []
  # Per step: hand 100 us; jdist 110 us one step per dispatch, 40 us with 32.
  per_step = {"jax_hand": 100e-6, "jdist": 110e-6, "jdist_multi": 40e-6,
              "jdist_fit_spe": 45e-6, "keras_jax_spe": 90e-6}
  for n in (1, 2, 4):
    for name, t in per_step.items():
      rows.append({"model": "mlp", "replicas": n, "framework": name,
                   "label": name, "steps_per_block": 512,
                   "samples_per_s": 256 / t, "seconds": [512 * t * n] * 3})
  text = "\n".join(step_model.targets_section(rows))
  assert "| Trainer fit, steps_per_execution=32 / Keras 3 fit, " \
         "steps_per_execution=32 (mlp) | 2 | **2.00** |" in text
  assert "hand-written JAX (mlp) | 1 | **0.91** | 0.91 to 0.91 | >= 0.9 | yes |" \
      in text
  model = "\n".join(step_model.model_section(rows))
  # dispatch = (110 - 40) * 32 / 31 us at every N.
  assert "| 1 | 110.0 | 40.0 | 72.3 |" in model
  assert "GPUs and TPUs" in model
  link = step_model.chart(rows, tmp_path / "throughput.png")
  assert link == ["![samples/s by framework and replica count](throughput.png)"]
  assert (tmp_path / "throughput.png").stat().st_size > 1000


@pytest.mark.multiprocess
def test_steps_per_execution_workers_run():
  res = _run([BENCH / "peers.py", *TINY, "--models", "mlp",
              "--frameworks", "jdist,jdist_multi,jdist_fit_spe"])
  assert not res["skipped"], res["skipped"]
  assert {r["framework"] for r in res["rows"]} == {
      "jdist", "jdist_multi", "jdist_fit_spe"}
  assert not res["loss_mismatch"], res["loss_mismatch"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not PEERS_PYTHON.exists(),
                    reason=f"no peers' venv at {PEERS_PYTHON} (`make bench` builds it)")
def test_parameter_server_against_tensorflow_runs():
  res = _run([BENCH / "ps.py", "--quick", "--json", "--frameworks", "jdist,tf",
              "--peers-python", PEERS_PYTHON], timeout=400)
  assert not res["skipped"], res["skipped"]
  by = {r["framework"]: r for r in res["rows"]}
  assert set(by) == {"jdist", "tf"}
  # Both start from the same weights on the same data.
  assert by["jdist"]["loss0"] == pytest.approx(by["tf"]["loss0"], rel=1e-4)


@pytest.mark.multiprocess
def test_zero_memory_runs():
  res = _run([BENCH / "zero_memory.py", "--quick", "--json", "--steps", "2"],
             devices=4)
  modes = res["modes"]
  assert set(modes) == {"mirrored", "zero1", "zero2"}
  assert all(modes[m]["state_ratio"] <= 0.3 for m in ("zero1", "zero2"))
  assert modes["zero2"]["collectives"]["reduce-scatter"] > 0



@pytest.mark.multiprocess
def test_fault_times_runs_and_renders():
  # The quickest case: a backup path that is a file fails fit() at once.
  start = time.time()
  res = _run([BENCH / "fault_times.py", "--json", "--case",
              "backup path is a file"], devices=1, timeout=180)
  elapsed = time.time() - start
  (row,) = res["rows"]
  (seconds,) = row["seconds"]
  # Timed inside the run from fit() to the error: within the run's own time.
  assert 0 < seconds < elapsed, (seconds, elapsed)
  text = "\n".join(_bench_module("fault_times").section(res))
  assert f"| backup path is a file | {_bench_module('fault_times').span([seconds])} |" \
      in text, text
  assert "From `python benchmarks/fault_times.py --case 'backup path is a file'` on " \
      in text, text


def test_make_bench_keeps_the_sections_it_does_not_write():
  """`make bench` rewrites RESULTS.md; the sections of scripts run apart
  (the docs point at some by name) stay, verbatim, after the ones it wrote,
  once each however many runs follow."""
  run = _bench_module("run")
  old = (BENCH / "RESULTS.md").read_text()
  headings = [l for l in old.splitlines() if l.startswith("## ")]
  written, apart = headings[:2], headings[2:]
  lines = ["# Benchmarks", "", "Written now.", ""]
  for heading in written:
    lines += [heading, "", "| a | 1.5x |"]
  new = "\n".join(lines + run.kept_sections(old, lines)) + "\n"
  again = "\n".join(lines + run.kept_sections(new, lines)) + "\n"
  assert again == new
  found = [l for l in new.splitlines() if l.startswith("## ")]
  assert found == written + apart  # each once, in the old order
  for section in old.split("\n## ")[1:]:
    if not any(section.startswith(h[3:]) for h in written):
      assert section.rstrip("\n") in new  # as it was
  assert new.count(run.KEPT) == 1
  assert run.kept_sections(new, lines + [l for l in new.splitlines()
                                         if l.startswith("## ")]) == []


@pytest.mark.multiprocess
def test_fit_overhead_runs_and_renders():
  res = _run([BENCH / "fit_overhead.py", "--quick", "--json"], devices=2)
  (row,) = res["rows"]  # --quick: the 2 devices only
  assert row["devices"] == 2
  steps = res["steps_per_round"]
  assert steps == res["examples"] // res["batch"] * res["epochs"]
  (hand,) = row["seconds"]["hand-written"]
  for loop, vs in row["vs_hand"].items():  # one round: the times' ratio
    (t,) = row["seconds"][loop]
    assert t > 0 and vs == pytest.approx(hand / t, rel=1e-9), row
    assert row["steps_per_s"][loop] == pytest.approx(steps / t, rel=1e-9)
  cpu = row["loop_cpu_us_per_step"]  # the loop thread's CPU, not the time
  assert set(cpu) == set(row["seconds"]) and all(v > 0 for v in cpu.values())
  text = "\n".join(_bench_module("fit_overhead").section(res))
  assert f"**{row['vs_hand']['fit']:.2f}x**" in text, text
  assert " / ".join(f"{v:.0f}" for v in cpu.values()) in text, text


def test_checkpoint_saves_runs_and_renders():
  """benchmarks/checkpoint_saves.py: a save's time and its content hash's,
  and the memory per save (in the script's process: `--quick`)."""
  res = _run([BENCH / "checkpoint_saves.py", "--quick", "--json"], devices=2)
  (label, t), = res["time"].items()
  assert min(t["save"], t["hash"], t["sums"]) > 0 and t["bytes"] > 64 << 10
  mem = res["memory"]
  assert [s for s, _ in mem["jdist"]["samples"]] == [0, 1, 2]
  assert mem["traced_bytes_per_save"] >= mem["jdist_own_bytes_per_save"]
  text = "\n".join(_bench_module("checkpoint_saves").section(res))
  assert (f"| {label} ({t['bytes']:,} bytes) | {t['save'] * 1e3:.1f} ms | "
          f"{t['hash'] * 1e3:.2f} ms |") in text, text
  assert (f"| `jdist.CheckpointManager(max_to_keep=3)` | "
          f"{mem['jdist']['bytes_per_save'] / 1024:.1f} KiB |") in text, text
  assert "From `python benchmarks/checkpoint_saves.py --quick` on" in text


@pytest.mark.multiprocess
def test_multihost_overhead_runs_alone():
  # One process over 2 devices: the smallest case (under `jdist launch` it
  # takes a minute on 2 busy cores); the cross-process parts are left out.
  res = _run([BENCH / "multihost_overhead.py", "--quick", "--json"], devices=2)
  assert (res["steps"], res["where"]) == (5, "1 process x 2 devices")
  times = res["us_per_step"]
  assert {"jdist step", "hand-written jit+shard_map", "bare psum"} <= set(times)
  assert all(0 < t["min"] <= t["median"] for t in times.values()), times
  assert res["jdist_vs_hand"] == pytest.approx(
      times["hand-written jit+shard_map"]["median"]
      / times["jdist step"]["median"], rel=1e-9)
  assert res["first_call_ms"] > 0
  assert len(res["fingerprint_us"]) == 3
  assert all(t["median"] > 0 for t in res["fingerprint_us"].values())
  # make bench's section (it runs the script under `jdist launch`).
  res["provenance"] = {"command": "here", "date": "today", "machine": "this",
                       "load_before": "0"}
  text = "\n".join(_bench_module("run").multihost_section(res))
  assert f"| jdist / hand-written speed (medians) | **{res['jdist_vs_hand']:.3f}** |" in text
  assert "the cross-process rows (key-value exchange, input agreement, " \
      "global batches) are not measured" in text, text
  assert "Not measured: boom" in "\n".join(
      _bench_module("run").multihost_section({"error": "boom"}))

@pytest.mark.multiprocess
@pytest.mark.slow
def test_mixed_precision_runs_and_renders():
  res = _run([BENCH / "mixed_precision.py", "--quick", "--json"], devices=2)
  assert set(res["curves"]) == {"float32", "mixed_bfloat16", "mixed_float16"}
  for policy in ("mixed_bfloat16", "mixed_float16"):
    assert res["curves"][policy]["max_rel_diff"] < 0.05
    assert res["cpu"]["batches"]["256"][policy]["residual_ratio"] <= 0.6
  text = "\n".join(_bench_module("run").mixed_precision_section(res))
  assert "| 256 | mixed_bfloat16 |" in text
  if "error" in res["tpu"]:  # no libtpu here (make bench installs it)
    assert "**TPU**: not measured" in text


@pytest.mark.multiprocess
def test_fault_times_quick_runs():
  # The threads backend's hung server and worker (timeout_seconds=1).
  res = _run([BENCH / "fault_times.py", "--quick", "--json"], timeout=120)
  rows = res["rows"]
  assert [r["fault"] for r in rows] == [
      "parameter server hangs (threads)", "worker hangs in a function (threads)"]
  assert all(len(r["seconds"]) == 1 and r["seconds"][0] > 0 for r in rows), rows
  text = "\n".join(_bench_module("fault_times").section(res))
  for r in rows:
    assert f"| {r['fault']} | " \
        f"{_bench_module('fault_times').span(r['seconds'])} |" in text, text


@pytest.mark.slow
def test_model_parallel_reports_what_it_measured(devices):
  """benchmarks/model_parallel.py's measurements on a tiny GPT: the memory
  figures are the arrays' bytes, the collectives are in the compiled step
  where the theory puts them, the speed ratio and MFU are the times'."""
  mp = _bench_module("model_parallel")
  cfg = mp.CONFIGS["tiny"]
  devices = devices[:4]
  setups = {k: mp.jdist_setup(k, cfg, devices) for k in mp.KINDS}
  mem = {k: mp.memory(s) for k, s in setups.items()}
  ratios = mp.memory_ratios(mem)
  total = sum(x.nbytes for x in jax.tree.leaves(setups["mirrored"].params))
  # Mirrored: every device holds the whole model, its gradients and adam's
  # two moments (and the step count).
  assert mem["mirrored"]["params_bytes"] == mem["mirrored"]["grads_bytes"] == total
  assert 2 * total <= mem["mirrored"]["opt_state_bytes"] <= 2 * total + 16
  for k in mp.KINDS:
    m = mem[k]
    assert m["state_bytes"] == (m["params_bytes"] + m["grads_bytes"]
                                + m["opt_state_bytes"])
    assert ratios[k]["state"] == m["state_bytes"] / mem["mirrored"]["state_bytes"]
    assert m["argument_bytes"] > 0 and m["temp_bytes"] > 0
  assert ratios["fsdp"]["state"] <= 0.30, ratios
  assert ratios["tensor"]["params"] <= 0.30, ratios
  # FSDP gathers the parameters in the forward pass and sums the gradients
  # in the backward pass (a reduce-scatter, or on CPU an all-reduce).
  comm = mp.communication(setups["fsdp"])["collectives"]
  gathered = comm["all-gather forward"]["bytes"]
  assert 0.5 * total < gathered <= total, comm
  assert (comm.get("reduce-scatter backward", {"bytes": 0})["bytes"]
          + comm.get("all-reduce backward", {"bytes": 0})["bytes"]) > 0, comm
  # Tensor parallel: Megatron's 2 all-reduces per block forward, 2 backward.
  per_block = mp.all_reduces_per_block(cfg, devices, setups["tensor"])
  assert per_block["per_block"] == {"forward": 2, "backward": 2, "update": 0}
  res = mp.speed(cfg, setups, rounds=1, block=2, kinds=("tensor",))
  for r in res.values():
    (jd,), (hand,) = r["seconds"]["jdist"], r["seconds"]["hand"]
    assert r["ratio"] == pytest.approx(hand / jd, rel=1e-9)
    tokens = cfg["batch"] * cfg["model"]["max_len"]
    assert r["tokens_per_s"]["jdist"] == pytest.approx(2 * tokens / jd)
    # Achieved: the compiled step's FLOPs over the time; MFU needs a peak,
    # which no CPU has: n/a, not a guess.
    assert r["achieved_flops_per_device"] == pytest.approx(
        r["flops_per_device_step"] / (jd / 2), rel=1e-9)
    assert r["compute_dtype"] == "float32" and r["mfu"] is None
    assert r["model_flops_per_step"] == mp.GPT(**cfg["model"]).train_flops(
        (cfg["batch"], cfg["model"]["max_len"]))
    # The same training: the same loss after the same steps.
    assert r["loss"]["jdist"] == pytest.approx(r["loss"]["hand"], abs=1e-5)
  text = "\n".join(mp.section({
      "config": cfg, "devices": 4, "device_kind": "cpu", "memory": mem,
      "memory_ratios": ratios, "communication": {
          k: mp.communication(setups[k]) for k in ("fsdp", "tensor")},
      "tensor_all_reduces": per_block, "speed": res, "seconds": 1.0,
      "provenance": {"command": "python benchmarks/model_parallel.py",
                     "date": "today", "machine": "here", "load_before": "0"}}))
  assert f"**{ratios['fsdp']['state']:.3f}**" in text
  assert f"**{res['tensor']['ratio']:.3f}**" in text
  assert "**2 forward, 2 backward** per block" in text
  assert "| n/a |" in text  # MFU on CPU


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not PEERS_PYTHON.exists(),
                    reason=f"no peers' venv at {PEERS_PYTHON} (`make bench` builds it)")
def test_model_parallel_against_keras_trains_the_same_gpt(devices, tmp_path):
  mp = _bench_module("model_parallel")
  cfg = mp.CONFIGS["tiny"]
  tensor = mp.jdist_setup("tensor", cfg, devices[:4])
  worker = mp.start_keras(cfg, tensor, str(PEERS_PYTHON), tmp_path)
  try:
    res = mp.keras_compare(cfg, tensor, worker, rounds=1, block=2)
  finally:
    worker.close()
  assert "error" not in res, res
  # Keras's GPT, loaded with jdist's weights, is the same function, and the
  # same adam steps on the same batches train it to the same loss.
  assert res["loss0"]["keras"] == pytest.approx(res["loss0"]["jdist"], rel=1e-5)
  assert res["loss"]["keras"] == pytest.approx(res["loss"]["jdist"], rel=1e-3)
  assert res["loss"]["jdist"] < res["loss0"]["jdist"]
  # Its LayoutMap splits the variables gpt_layout_map splits.
  leaves = jax.tree.leaves(tensor.params)
  split = sum(any(a is not None for a in x.sharding.spec) for x in leaves)
  assert res["keras_layout"] == f"{split} of {len(leaves)} variables split over 'model'"
  (ours,), (keras,) = res["seconds"]["jdist"], res["seconds"]["keras"]
  assert res["ratio"] == pytest.approx(keras / ours, rel=1e-9)


@pytest.mark.multiprocess
def test_snapshot_loop_runs_and_renders():
  """benchmarks/snapshot_loop.py under `jdist launch -n 2` (elastic_times.py's
  loop rows): trials of one snapshot's 10 steps, two rounds of each loop."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  env = {k: v for k, v in env.items() if not k.startswith(("JDIST_", "XLA_"))}
  done = subprocess.run(
      [sys.executable, "-m", "jdist.launch", "-n", "2", "--devices-per-process",
       "1", str(BENCH / "snapshot_loop.py"), "--quick"], env=env, cwd=REPO,
      capture_output=True, text=True, timeout=240)
  assert done.returncode == 0, done.stderr[-3000:]
  line = [l for l in done.stdout.splitlines() if l.startswith("[0] {")]
  loop = json.loads(line[-1][4:])
  assert loop["steps"] == 10 and loop["every"] == 10 and loop["trials"] == 2
  for key in ("seconds_per_step", "cpu_seconds_per_step",
              "process_cpu_seconds_per_step"):
    assert all(len(v) == 2 and min(v) > 0 for v in loop[key].values()), key
  times = _bench_module("elastic_times")
  text = "\n".join(times.loop_section(loop))
  cells = lambda v: (f"{statistics.median(v) * 1e3:.2f} "
                     f"({min(v) * 1e3:.2f})")
  cpu = loop["cpu_seconds_per_step"]
  assert (f"| no snapshot | {cells(loop['seconds_per_step']['none'])} | "
          f"1 | 1 | 1 | {cells(cpu['none'])} | 1 |" in text), text
  two = times.pooled([loop, loop])  # two runs as one: the trials end to end
  assert two["trials"] == 4 and two["cpu_seconds_per_step"]["none"] == \
      cpu["none"] * 2
  assert "| a snapshot every 10 steps, replicated |" in text, text
  process = cells(loop["process_cpu_seconds_per_step"]["none"])
  assert f"| 1 | {process} | 1 |" in text, text
  assert "| a snapshot every 10 steps, no replica |" in text, text
  split = loop["snapshot_seconds"]
  assert f"{split['write'] * 1e3:.2f} ms in the next `save`" in text, text


@pytest.mark.multiprocess
def test_pipelines_measures_the_bubble_from_the_stages_busy_time():
  """benchmarks/pipelines.py's bubble on a tiny schedule, each stage in a
  process of its own (`jdist launch -n 2`) pinned to a core of its own:
  every stage's every layer recorded forward and backward and gathered to
  process 0, the fractions the timeline's, and the section shows what was
  measured."""
  pl = _bench_module("pipelines")
  r = pl.bubble_in_processes(2, 1, width=32, rows=4, layers_per_stage=1,
                             steps=1, niceness=None, timeout=120)
  assert r["formula"] == pytest.approx(1 / 3) and r["iterations"] == 3
  assert 0 <= r["measured"] <= r["idle"] < 1, r
  for stage in ("0", "1"):  # one layer per stage, 2 microbatches, 2 phases
    phases = [phase for phase, _, _ in r["timeline"][stage]]
    assert phases.count("forward") == phases.count("backward") == 2, r
  cores = min(2, len(os.sched_getaffinity(0)))
  assert [len(c) for c in r["cores"]] == [1, 1], r["cores"]  # every thread
  assert len({c[0] for c in r["cores"]}) == cores, r["cores"]
  res = {"config": pl.CONFIGS["quick"], "devices": 8, "device_kind": "cpu",
         "bubble": [r], "seconds": 1.0,
         "memory": {"GPipe M=4": {k: {"argument_bytes": 2**20,
                                      "temp_bytes": 2**21 if k == "plain"
                                      else 2**19} for k in ("plain", "remat")}},
         "speed": {"PP": {"mesh": [1, 8, 1], "microbatches": 8,
                          "steps_per_s": {"jdist": 2.0, "hand": 2.0},
                          "ratio": 1.0, "ratio_spread": [0.9, 1.1],
                          "seconds": {"jdist": [1.0], "hand": [1.0]},
                          "loss_after": {"jdist": 1.0, "hand": 1.0}}},
         "provenance": {"command": "python benchmarks/pipelines.py",
                        "date": "today", "machine": "here", "load_before": "0"}}
  text = "\n".join(pl.section(res))
  assert f"**{r['measured']:.1%}**" in text and "33.3%" in text
  assert "| 0.25x |" in text and "**1.000**" in text
