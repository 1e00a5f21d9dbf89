"""The benchmark scripts still run (not how fast: timed tests are banned).

Tiny step counts, one round: these only keep benchmarks/overhead.py and
benchmarks/peers.py from rotting. The peers' part needs the venv that
`make bench` builds (.venv-peers, or PEERS_PYTHON) and is skipped without it.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
PEERS_PYTHON = pathlib.Path(os.environ.get(
    "PEERS_PYTHON", REPO / ".venv-peers" / "bin" / "python"))
TINY = ["--quick", "--json", "--replicas", "2", "--rounds", "1",
        "--steps", "mlp:3,cnn:1", "--warmup", "mlp:1,cnn:1"]


def _run(args, *, devices=2, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
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


def test_overhead_runs():
  results = _run([BENCH / "overhead.py", "--quick", "--json", "--devices", "2",
                  "--steps", "2", "--rounds", "1"])
  assert {(r["model"], r["devices"]) for r in results} == {("mlp", 2), ("cnn", 2)}
  assert all(r["ratio"] > 0 and r["jdist_steps_per_s"] > 0 for r in results)


def test_peers_jdist_part_runs():
  res = _run([BENCH / "peers.py", *TINY, "--frameworks", "jdist,jax_hand"])
  assert not res["skipped"], res["skipped"]
  got = {(r["model"], r["replicas"], r["framework"]) for r in res["rows"]}
  assert got == {(m, 2, f) for m in ("mlp", "cnn") for f in ("jdist", "jax_hand")}
  # The hand-written step trains the same model: same loss after the same steps.
  assert not res["loss_mismatch"], res["loss_mismatch"]
  assert all(r["jdist_speedup"] > 0 for r in res["rows"])


def test_parameter_server_jdist_part_runs():
  res = _run([BENCH / "ps.py", "--quick", "--json", "--frameworks", "jdist"])
  assert not res["skipped"], res["skipped"]
  (row,) = res["rows"]
  assert (row["workers"], row["framework"]) == (2, "jdist")
  assert row["examples_per_s"] > 0 and row["loss"] < row["loss0"]


def test_results_section_renders():
  sys.path.insert(0, str(BENCH))
  try:
    import run
  finally:
    sys.path.remove(str(BENCH))
  row = {"model": "mlp", "replicas": 2, "framework": "jdist", "label": "jdist",
         "batch": 256, "samples_per_s": 1e5, "samples_per_s_spread": [9e4, 1.1e5],
         "loss0": 2.5, "loss": 0.5}
  peer = dict(row, framework="torch_ddp", label="torch DDP", loss=0.5000001,
              jdist_speedup=2.0, jdist_speedup_spread=[1.5, 2.5])
  res = {"rows": [row, peer], "skipped": {"tf_mirrored": "did not install"},
         "versions": {"jdist": "jdist"}, "loss_mismatch": [],
         "settings": {"rounds": 1, "steps": {"mlp": 3}, "warmup": "mlp:1"}}
  text = "\n".join(run.peers_section(res))
  assert "| 2 | torch DDP | 100,000 | 90,000 to 110,000 | **2.00** |" in text
  assert "- tf_mirrored: did not install" in text
  assert "loss after 4 steps" in text


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


def test_issue_12_sections_render(tmp_path):
  """The targets, the chart and the step-time model read peers.py's rows."""
  sys.path.insert(0, str(BENCH))
  try:
    import step_model
  finally:
    sys.path.remove(str(BENCH))
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


def test_steps_per_execution_workers_run():
  res = _run([BENCH / "peers.py", *TINY, "--models", "mlp",
              "--frameworks", "jdist,jdist_multi,jdist_fit_spe"])
  assert not res["skipped"], res["skipped"]
  assert {r["framework"] for r in res["rows"]} == {
      "jdist", "jdist_multi", "jdist_fit_spe"}
  assert not res["loss_mismatch"], res["loss_mismatch"]


def test_parameter_server_section_renders():
  sys.path.insert(0, str(BENCH))
  try:
    import ps
  finally:
    sys.path.remove(str(BENCH))
  jd = {"workers": 2, "framework": "jdist", "label": "jdist, threads",
        "examples_per_s": 2e5, "spread": [1.5e5, 2.5e5], "loss0": 2.5,
        "loss": 2.2, "vs_tf": 3.0, "vs_tf_spread": [2.0, 4.0]}
  tf = dict(jd, framework="tf", label="TensorFlow", examples_per_s=6e4,
            spread=[5e4, 7e4])
  del tf["vs_tf"], tf["vs_tf_spread"]
  text = "\n".join(ps.section({"rows": [jd, tf], "skipped": {},
                               "versions": {"jdist": "jdist"},
                               "settings": {"rounds": 1, "steps": 20,
                                            "warmup": 5}}))
  assert "| 2 | jdist, threads | 200,000 | 150,000 to 250,000 | **3.00** |" in text
  assert "Slower than TensorFlow here (median): none." in text


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not PEERS_PYTHON.exists(),
                    reason=f"no peers' venv at {PEERS_PYTHON} (`make bench` builds it)")
def test_parameter_server_against_tensorflow_runs():
  res = _run([BENCH / "ps.py", "--quick", "--json", "--frameworks", "jdist,tf",
              "--peers-python", PEERS_PYTHON], timeout=400)
  assert not res["skipped"], res["skipped"]
  by = {r["framework"]: r for r in res["rows"]}
  assert set(by) == {"jdist", "tf"} and by["jdist"]["vs_tf"] > 0
  # Both start from the same weights on the same data.
  assert by["jdist"]["loss0"] == pytest.approx(by["tf"]["loss0"], rel=1e-4)


def test_zero_memory_runs():
  res = _run([BENCH / "zero_memory.py", "--quick", "--json", "--steps", "2"],
             devices=4)
  modes = res["modes"]
  assert set(modes) == {"mirrored", "zero1", "zero2"}
  assert all(modes[m]["state_ratio"] <= 0.3 for m in ("zero1", "zero2"))
  assert modes["zero2"]["collectives"]["reduce-scatter"] > 0


@pytest.mark.slow
def test_mixed_precision_runs_and_renders():
  res = _run([BENCH / "mixed_precision.py", "--quick", "--json"], devices=2)
  assert set(res["curves"]) == {"float32", "mixed_bfloat16", "mixed_float16"}
  for policy in ("mixed_bfloat16", "mixed_float16"):
    assert res["curves"][policy]["max_rel_diff"] < 0.05
    assert res["cpu"]["batches"]["256"][policy]["residual_ratio"] <= 0.6
  sys.path.insert(0, str(BENCH))
  try:
    import run
  finally:
    sys.path.remove(str(BENCH))
  text = "\n".join(run.mixed_precision_section(res))
  assert "| 256 | mixed_bfloat16 |" in text
  if "error" in res["tpu"]:  # no libtpu here (make bench installs it)
    assert "**TPU**: not measured" in text
  tpu = {"device": "TPU v5 lite", "batches": {"8192": {
      p: {"temp_bytes": b, "temp_ratio": r} for p, b, r in [
          ("float32", 2**20, 1.0), ("mixed_bfloat16", 2**19, 0.5),
          ("mixed_float16", 0, None)]}}}
  text = "\n".join(run.mixed_precision_section(dict(res, tpu=tpu)))
  assert "| 8192 | mixed_bfloat16 | 0.5 MB | **0.50** |" in text
  assert "| 8192 | mixed_float16 | 0.0 MB | n/a |" in text
