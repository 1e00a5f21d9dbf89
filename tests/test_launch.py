"""`jdist launch`, run as a user runs it, on small plain-Python scripts."""

import glob
import os
import re
import signal
import sys
import tempfile
import textwrap
import time

import pytest

from jdist._src.launcher import launch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "multiprocess"))
import harness  # noqa: E402

# Every test but the first starts `jdist launch` and its processes.
pytestmark = pytest.mark.multiprocess


@pytest.fixture
def script(tmp_path):
  def write(body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)
  return write


def test_arguments_are_checked(tmp_path, capsys):
  for argv, message in [
      (["launch", "job.py"], "required: -n"),
      (["-n", "0", __file__], "-n must be at least 1"),
      (["-n", "2", str(tmp_path / "missing.py")], "no such script"),
      (["-n", "2", "--devices-per-process", "0", __file__],
       "--devices-per-process must be at least 1"),
      (["-n", "2", "--nnodes", "2", __file__], "not both"),
      (["--nnodes", "4:2", __file__], "1 <= MIN <= MAX"),
      (["--nnodes", "two", __file__], "--nnodes must be MIN:MAX or N"),
      (["-n", "2", "--min-processes", "3", __file__],
       "--min-processes must be from 1 to -n (2)"),
      (["--nnodes", "2:4", "--min-processes", "1", __file__],
       "--min-processes goes with -n"),
      (["-n", "4", "--nproc-per-node", "2", __file__], "-n counts processes"),
      (["-n", "2", "--max-restarts", "-1", __file__], "--max-restarts must be 0"),
      (["-n", "2", "--stuck-timeout", "0", __file__], "--stuck-timeout must be"),
      (["--nnodes", "2", "--rdzv-endpoint", "nohost", __file__],
       "--rdzv-endpoint must be HOST:PORT"),
  ]:
    with pytest.raises(SystemExit):
      launch.parse_args(argv)
    assert message in capsys.readouterr().err


def test_torchrun_sizes_and_jdist_sizes():
  """`-n N` is N nodes of one process; `--min-processes` lowers the minimum."""
  for argv, sizes in [
      (["-n", "4"], (4, 4, 1)),
      (["-n", "4", "--min-processes", "2"], (2, 4, 1)),
      (["--nnodes", "2:4"], (2, 4, 1)),
      (["--nnodes", "3", "--nproc-per-node", "2"], (3, 3, 2)),
  ]:
    args = launch.parse_args([*argv, __file__])
    assert (args.min_nodes, args.max_nodes, args.nproc_per_node) == sizes, argv


def test_each_process_gets_its_rank_and_devices(script):
  job = script("""
      import os
      names = ["JDIST_PROCESS_ID", "JDIST_NUM_PROCESSES", "JDIST_LOCAL_DEVICE_IDS",
               "XLA_FLAGS", "JDIST_RESTART_COUNT", "JDIST_MAX_RESTARTS"]
      print(*[os.environ[k] for k in names], sep="|")
      print("coordinator", os.environ["JDIST_COORDINATOR_ADDRESS"])
  """)
  r = harness.run_launcher(["-n", "3", "--devices-per-process", "2", job],
                           timeout=60, XLA_FLAGS="--xla_dump_to=/tmp/x")
  assert r.returncode == 0, r.output
  flags = "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
  assert f"[1] 1|3|2,3|{flags}|0|0" in r.stdout, r.stdout
  assert f"[2] 2|3|4,5|{flags}|0|0" in r.stdout, r.stdout
  coordinators = set(re.findall(r"coordinator (127\.0\.0\.1:\d+)", r.stdout))
  assert len(coordinators) == 1, r.stdout
  args = launch.parse_args(["launch", "-n", "2", __file__, "--lr", "0.1", "-v"])
  assert (args.num_processes, args.args) == (2, ["--lr", "0.1", "-v"])


def test_output_is_prefixed_by_rank(script):
  job = script("""
      import os, sys
      rank = os.environ["JDIST_PROCESS_ID"]
      print("hello from", rank, "of", os.environ["JDIST_NUM_PROCESSES"], sys.argv[1:])
      print("warning", rank, file=sys.stderr)
  """)
  r = harness.run_launcher(["-n", "3", job, "--flag", "x"], timeout=60)
  assert r.returncode == 0, r.output
  for rank in range(3):
    assert f"[{rank}] hello from {rank} of 3 ['--flag', 'x']" in r.stdout
    assert f"[{rank}] warning {rank}" in r.stderr


def test_a_failing_process_stops_the_others(script):
  job = script("""
      import os, sys, time
      if os.environ["JDIST_PROCESS_ID"] == "1":
          time.sleep(0.5)
          raise ValueError("bad shard in process 1")
      time.sleep(120)
  """)
  r = harness.run_launcher(["-n", "3", "--grace-period", "2", job], timeout=60)
  assert r.returncode == 1, r.output
  assert r.seconds < 20
  assert "jdist launch: process 1 of 3 failed (exit code 1)" in r.stderr
  assert "  | ValueError: bad shard in process 1" in r.stderr  # its error, repeated


def test_a_killed_process_is_reported(script):
  job = script("""
      import os, signal, time
      if os.environ["JDIST_PROCESS_ID"] == "0":
          os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(120)
  """)
  r = harness.run_launcher(["-n", "2", "--grace-period", "1", job], timeout=60)
  assert r.returncode == 128 + 9, r.output
  assert "process 0 of 2 failed (killed by SIGKILL)" in r.stderr


def test_modules_and_the_jdist_command(tmp_path):
  (tmp_path / "mymod.py").write_text(
      "import os\nprint('module rank', os.environ['JDIST_PROCESS_ID'])\n")
  r = harness.run_launcher(["-n", "2", "-m", "mymod"], timeout=60,
                           PYTHONPATH=f"{tmp_path}{os.pathsep}{harness.ROOT}")
  assert r.returncode == 0, r.output
  assert "[1] module rank 1" in r.stdout
  # `python -m jdist launch ...`, what the `jdist` console script runs.
  cmd = [sys.executable, "-m", "jdist", "launch", "-n", "2", "-m", "mymod"]
  env = harness.base_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{harness.ROOT}")
  r = harness.run_processes([(cmd, env)], timeout=60)[0]
  assert r.returncode == 0 and "[0] module rank 0" in r.stdout, r.output


def test_the_launcher_starts_without_loading_jax():
  """`jdist launch` (and its per-host agent) imports neither JAX nor NumPy:
  it starts in a tenth of a second, not one second more for each launcher
  and agent; the processes it starts load what they use."""
  code = ("import sys, jdist.launch; "
          "print(sorted(m for m in ('jax', 'numpy') if m in sys.modules))")
  env = harness.base_env(PYTHONPATH=harness.ROOT)
  r = harness.run_processes([([sys.executable, "-c", code], env)],
                            timeout=60)[0]
  assert r.returncode == 0 and r.stdout.strip() == "[]", r.output


# Each rank ignores SIGTERM, as one blocked in a collective does (JAX's
# preemption handler takes the signal), and would live for two minutes.
STUBBORN = """
    import os, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(120)
"""


def test_ranks_die_with_a_killed_launcher(script):
  """A scheduler or the OOM killer SIGKILLs `jdist launch`: no rank survives.

  (A SIGTERM to the launcher: test_multiprocess.py, with JAX processes.)
  """
  with harness.launched(["-n", "2", script(STUBBORN)], ["[0] ready", "[1] ready"]
                        ) as (launcher, ranks):
    assert len(ranks) == 2, ranks
    # Its processes' health files, which a killed launcher cannot remove.
    left = glob.glob(os.path.join(tempfile.gettempdir(),
                                  f"jdist-node-{launcher.popen.pid}-*"))
    assert len(left) == 2, left  # one per node
    os.kill(launcher.popen.pid, signal.SIGKILL)
    assert launcher.popen.wait(timeout=10) == -signal.SIGKILL
    assert harness.wait_gone(ranks, timeout=5) == []
  # The next launcher removes them.
  assert harness.run_launcher(["-n", "1", script("")], timeout=60).returncode == 0
  assert [d for d in left if os.path.exists(d)] == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_elastic_launcher_ends_within_its_grace_period(script, sig):
  """SIGTERM or SIGINT to an elastic `jdist launch`: it forwards the signal,
  kills what still runs after `--grace-period` (its ranks ignore SIGTERM, as
  JAX's preemption handler does), and ends, with every process, within the
  grace period and 3 s; its rendezvous does not outlive it."""
  grace = 2
  args = ["--nnodes", "2", "--max-restarts", "3", "--grace-period", grace,
          script(STUBBORN)]
  with harness.launched(args, ["[0] ready", "[1] ready"]) as (launcher, ranks):
    assert len(ranks) == 2, ranks
    sent = time.monotonic()
    os.kill(launcher.popen.pid, sig)
    code = launcher.popen.wait(timeout=60)
    took = time.monotonic() - sent
    print(f"{signal.Signals(sig).name}: the launcher ended {took:.2f} s later")
    assert code == 128 + sig, launcher.output()[-3000:]
    assert took < grace + 3, took
    assert harness.wait_gone(ranks, timeout=1) == []
    name = signal.Signals(sig).name
    killed = ("; processes [0, 1] were still running after the grace period "
              f"of {grace} s and were killed" if sig == signal.SIGTERM else "")
    assert (f"jdist launch: stopped by {name}, which it forwarded to the "
            f"processes{killed}.") in launcher.output(), launcher.output()


@pytest.mark.parametrize("culprit, peer_delay, culprit_delay", [
    (0, 0.0, 1.0),  # process 0, which hosts the coordinator, lingers for its peers
    (1, 0.5, 0.5),  # both end within one poll of the launcher
])
def test_the_process_that_failed_is_named_not_its_peer(script, culprit,
                                                       peer_delay, culprit_delay):
  """One process raises; the other ends with the PeerFailureError jdist gives it."""
  job = script(f"""
      import os, sys, time
      start = float(sys.argv[1])
      if os.environ["JDIST_PROCESS_ID"] == "{culprit}":
          time.sleep(max(0, start + {culprit_delay} - time.time()))
          raise ValueError("bad shard in process {culprit}")
      print("jdist.PeerFailureError: process {culprit} failed with ValueError: "
            "bad shard in process {culprit}. This process cannot continue "
            "without it", file=sys.stderr, flush=True)
      time.sleep(max(0, start + {peer_delay} - time.time()))
      sys.exit(1)
  """)
  r = harness.run_launcher(["-n", "2", job, time.time() + 3], timeout=60)
  assert r.returncode == 1, r.output
  assert (f"jdist launch: process {culprit} of 2 failed (exit code 1)"
          in r.stderr), r.stderr
  assert f"  | ValueError: bad shard in process {culprit}" in r.stderr


# Each process prints its pid and attempt; once every process of the attempt
# runs (a file each in DIR), it does its FAULTS (ATTEMPT:RANK:WHAT), and
# otherwise waits until the launcher stops it (or exits 0 in the last attempt).
ELASTIC = """
    import os, signal, sys, threading, time
    rank, attempt = os.environ["JDIST_PROCESS_ID"], os.environ["JDIST_RESTART_COUNT"]
    world = int(os.environ["JDIST_NUM_PROCESSES"])
    print(f"pid {os.getpid()} attempt {attempt} of {os.environ['JDIST_MAX_RESTARTS']}"
          f" world {world}", flush=True)
    ready = os.path.join(sys.argv[1], f"{attempt}-{{}}")
    open(ready.format(rank), "w").close()
    deadline = time.monotonic() + 30
    while not all(os.path.exists(ready.format(r)) for r in range(world)):
        assert time.monotonic() < deadline, "the other processes never started"
        time.sleep(0.02)
    for fault in sys.argv[2:]:
        a, r, what = fault.split(":")
        if (a, r) == (attempt, rank):
            if what == "exit3":
                sys.exit(3)
            os.kill(os.getpid(), getattr(signal, what))
    if attempt != os.environ["JDIST_MAX_RESTARTS"]:
        threading.Event().wait()
"""


def _pids(output: str) -> list:
  return [int(p) for p in re.findall(r"\] pid (\d+) ", output)]


def test_failures_restart_the_job_with_its_attempt_number(script, tmp_path):
  r = harness.run_launcher(["--nnodes", "3", "--max-restarts", "2",
                            script(ELASTIC), tmp_path, "0:1:exit3", "1:0:SIGKILL"],
                           timeout=60)
  assert r.returncode == 0, r.output
  for attempt in range(3):
    for rank in range(3):
      assert f"[{rank}] pid" in r.stdout
    assert r.stdout.count(f"attempt {attempt} of 2 world 3") == 3, r.stdout
  assert ("jdist launch: attempt 0: process 1 of 3 failed (exit code 3); "
          "restarting the job (restart 1 of at most 2)." in r.stderr), r.stderr
  assert ("jdist launch: attempt 1: process 0 of 3 failed (killed by SIGKILL); "
          "restarting the job (restart 2 of at most 2)." in r.stderr), r.stderr
  assert "the job completed after 2 restarts" in r.stderr
  assert harness.wait_gone(_pids(r.stdout), timeout=5) == []


def test_three_failures_end_the_job_with_one_message(script, tmp_path):
  """`--max-restarts 2`: an exit code, a SIGKILL and a stopped process."""
  r = harness.run_launcher(
      ["--nnodes", "3", "--max-restarts", "2", "--stuck-timeout", "1",
       "--grace-period", "2", script(ELASTIC), tmp_path, "0:1:exit3", "1:0:SIGKILL",
       "2:2:SIGSTOP"], timeout=90)
  assert r.returncode == 1, r.output
  message = r.stderr[r.stderr.index("jdist launch: the job failed"):]
  lines = message.splitlines()
  assert lines[:5] == [
      "jdist launch: the job failed 3 times, and --max-restarts 2 allows 2 "
      "restarts.",
      "Each failure:",
      "  attempt 0: process 1 of 3 failed (exit code 3)",
      "  attempt 1: process 0 of 3 failed (killed by SIGKILL)",
      lines[4]], message
  stuck = re.fullmatch(
      r"  attempt 2: process 2 of 3 failed \(stuck: stopped by a signal "
      r"\(SIGSTOP or a debugger\) for (\d+\.\d) s, before it joined the job\)",
      lines[4])
  assert stuck and float(stuck.group(1)) >= 1, message
  assert lines[5] == "The end of process 2's error output in attempt 2:"
  assert harness.wait_gone(_pids(r.stdout), timeout=5) == []


# Waits until DIR/release exists (at most a minute), then exits 0.
HOLD = """
    import os, sys, time
    print(f"pid {os.getpid()} attempt {os.environ['JDIST_RESTART_COUNT']} "
          f"world {os.environ['JDIST_NUM_PROCESSES']} ppid {os.getppid()}", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(sys.argv[1], "release")):
        assert time.monotonic() < deadline, "never released"
        time.sleep(0.02)
"""


def test_a_spare_node_replaces_one_that_goes_away(script, tmp_path):
  """Three hosts for `--nnodes 1:2`: two run, the third waits as a spare; when
  a running host goes away, the next attempt runs on the spare."""
  port = harness.free_port()
  args = ["--nnodes", "1:2", "--max-restarts", "1", "--rdzv-endpoint",
          f"127.0.0.1:{port}", script(HOLD), tmp_path]
  cmd, env = harness.launcher_cmd(args), harness.base_env(1)
  with harness.Background(cmd, env) as host:
    host.wait_for("hosts the job's rendezvous", timeout=60)
    with harness.Background(cmd, env) as b, harness.Background(cmd, env) as c:
      launchers = [host, b, c]
      _wait_until(lambda: sum("attempt 0 world 2" in l.output()
                              for l in launchers) == 2, launchers)
      running = [l for l in (b, c) if "attempt 0" in l.output()]
      spare = [l for l in (b, c) if "attempt 0" not in l.output()]
      assert len(running) == len(spare) == 1
      os.kill(running[0].popen.pid, signal.SIGKILL)
      _wait_until(lambda: "attempt 1 world 2" in spare[0].output(),
                  [host, spare[0]])
      (tmp_path / "release").touch()
      for launcher in (host, spare[0]):
        assert launcher.popen.wait(timeout=60) == 0, launcher.output()
      assert re.search(r"attempt 0: node \d \(127\.0\.0\.1, process 1\) went "
                       r"away \(its launcher's connection closed\)",
                       host.output()), host.output()
      pids = _pids(host.output() + b.output() + c.output())
  assert harness.wait_gone(pids, timeout=5) == []


def _wait_until(condition, launchers, timeout: float = 60) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    ended = [l.output() for l in launchers if l.popen.poll() is not None]
    assert not ended and time.monotonic() < deadline, ended
    time.sleep(0.05)


def test_a_node_started_for_another_job_is_refused(script, tmp_path):
  port = harness.free_port()
  job = script(HOLD)
  endpoint = ["--rdzv-endpoint", f"127.0.0.1:{port}"]
  with harness.Background(harness.launcher_cmd(
      ["--nnodes", "2", *endpoint, job, tmp_path]), harness.base_env(1)) as host:
    host.wait_for("hosts the job's rendezvous", timeout=60)
    other = harness.run_launcher(["--nnodes", "2", *endpoint, job, "other"],
                                 timeout=60)
    assert other.returncode == 1, other.output
    assert (f"jdist launch: the rendezvous at 127.0.0.1:{port} refused this "
            "node: this rendezvous runs another job (--nnodes 2:2 "
            f"--max-restarts 0 {job} {tmp_path}); this node was started for "
            f"--nnodes 2:2 --max-restarts 0 {job} other." in other.stderr), \
        other.stderr
    assert "pid" not in other.stdout


def test_too_few_nodes_end_the_job(script, tmp_path):
  port = harness.free_port()
  r = harness.run_launcher(["--nnodes", "2:3", "--rdzv-endpoint",
                            f"127.0.0.1:{port}", "--join-timeout", "1",
                            script(HOLD), tmp_path], timeout=60)
  assert r.returncode == 1, r.output
  assert ("jdist launch: the job cannot go on: 1 node joined attempt 0, fewer "
          "than the minimum of 2 (--nnodes 2:3), and no other joined within "
          "--join-timeout 1 s." in r.stderr), r.stderr
  assert "pid" not in r.stdout


def test_a_closed_rendezvous_leaves_no_thread_or_socket():
  import threading
  from jdist._src.launcher import rendezvous, rendezvous_tcp
  spec = rendezvous.JobSpec(1, 1, 0, ("train.py",))
  server = rendezvous_tcp.Server(rendezvous.Rendezvous(spec), "127.0.0.1", 0)
  client = rendezvous_tcp.Client(*server.address, timeout=10)
  client.hello(spec.asdict(), nproc=1)
  server.close(linger=0)
  assert not [t for t in threading.enumerate()
              if t.name.startswith("jdist-rendezvous")]
  with pytest.raises(rendezvous_tcp.RendezvousError, match="ended"):
    client.request("view")
  client.close()
