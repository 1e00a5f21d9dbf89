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
