"""The Ray backend (`jdist[ray]`): parameter servers and workers as Ray
actors, which Ray starts, places, restarts and reaches.

A server is never restarted (its variables are lost); Ray restarts a dead
worker and the coordinator sends it its functions again. Workers are elastic
between `ray_options["min_workers"]` and `["max_workers"]`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any

import jax

from jdist._src.errors import ParameterServerError, WorkerFailedError
from jdist._src.ps import worker as worker_lib
from jdist._src.ps.excused import EXCUSED, listen_to_compiles
from jdist._src.ps.remote import to_numpy
from jdist._src.ps.server import ParameterServer, unanswered
from jdist._src.strategies.mirrored import MirroredStrategy


def _ray():
  try:
    import ray
  except ImportError as e:
    raise ImportError(
        "ParameterServerStrategy(backend='ray') needs Ray: pip install "
        "'jdist[ray]' (or pip install ray).") from e
  return ray


def _pickle():
  return _ray().cloudpickle


class TrainingWorker:
  """The body of a worker actor: a worker context over its process's devices,
  timed as a threads worker is; `health` is answered by a thread of its own."""

  def __init__(self, index: int, num_workers: int, strategy_bytes: bytes):
    listen_to_compiles()
    self._running = None  # (thread, its clock) of the function running
    strategy = _pickle().loads(strategy_bytes)
    # The process's own devices (XLA_FLAGS of its runtime_env on CPU).
    # A read is a round trip: start each step from the values the servers
    # answered the last update with (its next call is already waiting).
    self._ctx = worker_lib.WorkerContext(index, num_workers, MirroredStrategy(),
                                         strategy, reuse_answers=True)
    self._functions: dict = {}

  def ping(self) -> int:
    return os.getpid()

  def where(self) -> str:
    """The worker's process and Ray node, for the coordinator's log."""
    node = _ray().get_runtime_context().get_node_id()
    return f"pid {os.getpid()} on node {node[:12]}"

  def run(self, key: str, fn_bytes: bytes | None, definitions: list,
          args_bytes: bytes) -> bytes:
    pickle = _pickle()
    if fn_bytes is not None:
      self._functions[key] = pickle.loads(fn_bytes)
    for name, data in definitions:
      self._ctx.definitions[name] = pickle.loads(data)
    fn = self._functions[key]
    args, kwargs = pickle.loads(args_bytes)
    # Timed from here: loading the function may import modules, which does
    # not count, as it does not under threads.
    thread = threading.current_thread()
    self._running = (thread, EXCUSED.clock(thread))
    try:
      value = worker_lib.run(self._ctx, fn, args, kwargs)
    finally:
      self._running = None
    return pickle.dumps(to_numpy(value))

  def health(self) -> tuple:
    """`(seconds, excused)`: how long the running function has run (excused
    time aside; 0 when none runs), and whether its time is excused now."""
    running = self._running
    if running is None:
      return 0.0, False
    thread, started = running
    return EXCUSED.clock(thread) - started, EXCUSED.active(thread)

  def restart(self) -> None:
    self._ctx.restart()


class RayStore:
  """The servers' API over parameter-server actors (picklable: workers use
  it); a call waits `timeout` seconds at most."""

  def __init__(self, actors: list, addresses: tuple, timeout: float):
    self._actors = actors
    self._addresses = addresses
    self._timeout = timeout
    self._closed = False

  def _call(self, calls: dict) -> dict:
    """`{server: (method, args)}` -> `{server: result}`, calls in parallel."""
    ray = _ray()
    if self._closed:
      raise ParameterServerError(
          "The parameter servers are shut down (the coordinator's shutdown() "
          "stopped the cluster); their variables are gone.")
    refs = {s: getattr(self._actors[s], m).remote(*a)
            for s, (m, a) in calls.items()}
    deadline = time.monotonic() + self._timeout
    # A worker's time waiting here is the servers' to account for.
    EXCUSED.begin(threading.current_thread())
    try:
      return {s: self._get(ray, s, ref, deadline) for s, ref in refs.items()}
    finally:
      EXCUSED.end(threading.current_thread())

  def _get(self, ray, s: int, ref, deadline: float):
    """Server `s`'s answer `ref`, waited for until `deadline`."""
    try:
      return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
      raise unanswered(s, self._addresses[s], self._timeout) from None
    except ray.exceptions.RayActorError as e:
      raise ParameterServerError(
          f"Parameter server {s} ({self._addresses[s]}) is unavailable: its "
          f"actor died ({type(e).__name__}). Its variables are lost: restart "
          "the cluster and restore them from a checkpoint.") from None
    except ray.exceptions.RayTaskError as e:
      cause = getattr(e, "cause", None)
      raise ParameterServerError(
          f"Parameter server {s} ({self._addresses[s]}) failed: "
          f"{type(cause).__name__}: {cause}") from None

  def create(self, set_id, per_server: dict, kinds: dict) -> None:
    self._call({s: ("create", (set_id, shards, kinds[s]))
                for s, shards in per_server.items()})

  def read(self, set_id, servers) -> dict:
    return self._call({s: ("read", (set_id,)) for s in servers})

  def push(self, set_id, pushes: dict, max_staleness) -> dict:
    return self._call({s: ("push", (set_id, base, changes, max_staleness))
                       for s, (base, changes) in pushes.items()})

  def assign(self, set_id, per_server: dict) -> None:
    self._call({s: ("assign", (set_id, shards))
                for s, shards in per_server.items()})

  def delete(self, set_id) -> None:
    if self._closed:
      return
    for actor in self._actors:
      try:
        actor.delete.remote(set_id)  # nobody waits for a variable set's end
      except Exception:  # the server is dead: nothing to free there
        pass

  def stats(self) -> list:
    got = self._call({s: ("stats", ()) for s in range(len(self._actors))})
    return [got[s] for s in range(len(self._actors))]

  def close(self) -> None:
    """Refuses every later call: the servers are being shut down."""
    self._closed = True


_log = logging.getLogger(__name__)

# How often the cluster's free resources are looked at for a worker to add.
_WATCH_EVERY = 0.5

# A busy worker is asked how it does every this fraction of the timeout.
_PING_EVERY = 0.25

# Why a busy worker counts as hung (`RayWorker._wait`), as the error says it.
_HUNG = {
    "silent": "Worker {index} did not answer for timeout_seconds={timeout:g} "
              "while it ran a scheduled function: it hangs (stopped, or stuck "
              "outside Python).",
    "slow": "Worker {index} did not finish a scheduled function within "
            "timeout_seconds={timeout:g} (compiling and waiting on parameter "
            "servers aside): it counts as hung.",
}

# How long a worker whose process died may take to come back (Ray restarts it)
# before its functions are left to the other workers for good.
RESTART_TIMEOUT = 600.0


class RayWorker:
  """The coordinator's side of one worker actor."""

  def __init__(self, index: int, actor, timeout: float):
    self.index = index
    self.actor = actor
    self._timeout = timeout
    self._sent: set = set()  # functions this incarnation of the actor has
    self._hung = False  # this incarnation went silent and was killed
    self.recovering = False  # Ray restarts it: free resources wait for it
    self.death = ""  # why it is gone for good, once it is

  depth = 2  # the next call waits in the actor while it runs one

  def submit(self, closure):
    """Sends the closure to the actor (its function and datasets only once)."""
    key, fn_bytes, definitions, args_bytes = closure.payload
    send = None if key in self._sent else fn_bytes
    new = [(k, b) for k, b in definitions if k not in self._sent]
    # The actor runs calls in order: later ones find what this one brings.
    self._sent.add(key)
    self._sent.update(k for k, _ in new)
    return self.actor.run.remote(key, send, new, args_bytes)

  def result(self, ref) -> Any:
    """The closure's result; raises `WorkerFailedError` if the actor died or
    went silent for `timeout` (then it is killed, for Ray to restart it)."""
    ray = _ray()
    if self._hung and not ray.wait([ref], timeout=0)[0]:
      # Sent to the hung process before it was killed: lost with it (its
      # failure may take Ray a while to report).
      raise WorkerFailedError(
          f"Worker {self.index} hung with this function queued.")
    why = "" if self._hung else self._wait(ref)
    if why:
      ray.kill(self.actor, no_restart=False)
      self._sent.clear()
      self._hung = True
      raise WorkerFailedError(
          _HUNG[why].format(index=self.index, timeout=self._timeout) +
          " Its process was killed for Ray to restart it, and its functions "
          "run again on a worker.")
    try:
      out = ray.get(ref)
    except ray.exceptions.RayActorError as e:
      self._sent.clear()
      raise WorkerFailedError(
          f"Worker {self.index}'s actor died ({type(e).__name__}"
          f"{_death_reason(e)}).") from None
    except ray.exceptions.RayTaskError as e:
      raise _unwrap(e) from None
    return _pickle().loads(out)

  def _wait(self, ref) -> str:
    """Waits for `ref` while the actor answers health calls: "" once it is
    ready, else the `_HUNG` key of why not ("silent" or "slow")."""
    ray = _ray()
    heard = time.monotonic()
    ping, next_ping = self._health(), None
    while True:
      now = time.monotonic()
      if now - heard > self._timeout:
        return "silent"
      wake = heard + self._timeout if next_ping is None else next_ping
      refs = [ref] if ping is None else [ref, ping]
      ready, _ = ray.wait(refs, num_returns=1, timeout=max(0.0, wake - now))
      if ref in ready:
        return ""
      if ping is not None and ping in ready:
        try:
          seconds, excused = ray.get(ping)
        except ray.exceptions.RayError:  # dead: `ref` says how
          seconds, excused = 0.0, True
        else:
          heard = time.monotonic()
        if seconds > self._timeout and not excused:
          return "slow"
        # Asked again when its time is up, or sooner to hear it lives.
        ping, next_ping = None, time.monotonic() + max(0.05, min(
            self._timeout * _PING_EVERY, self._timeout - seconds))
      elif ping is None and time.monotonic() >= next_ping:
        ping, next_ping = self._health(), None

  def _health(self):
    return self.actor.health.options(concurrency_group="health").remote()

  def recover(self) -> bool:
    """Waits for Ray to bring the actor back (a restart imports JAX anew, so up
    to `RESTART_TIMEOUT`); False if it will not."""
    ray = _ray()
    self._sent.clear()
    self._hung = False
    self.recovering = True
    try:
      deadline = time.monotonic() + max(self._timeout, RESTART_TIMEOUT)
      while time.monotonic() < deadline:
        try:
          ray.get(self.actor.restart.remote(),
                  timeout=max(0.0, min(self._timeout,
                                       deadline - time.monotonic())))
          return True
        except ray.exceptions.ActorDiedError as e:
          # Out of restarts, its node gone, or its constructor failed.
          self.death = f"its actor died for good{_death_reason(e)}"
          return False
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
          time.sleep(0.1)  # restarting
      return False
    finally:
      self.recovering = False

  def pid(self) -> int:
    return _ray().get(self.actor.ping.remote(), timeout=self._timeout)


def _demand(worker_opts: dict) -> dict:
  """The Ray resources one worker actor takes, by resource name."""
  demand = {"CPU": float(worker_opts.get("num_cpus") or 0),
            "GPU": float(worker_opts.get("num_gpus") or 0),
            "memory": float(worker_opts.get("memory") or 0)}
  demand.update({k: float(v) for k, v in
                 (worker_opts.get("resources") or {}).items()})
  return {k: v for k, v in demand.items() if v > 0}


def _death_reason(error) -> str:
  """Ray's reason for an actor's death ("...: its node has died"), or ""."""
  for line in str(error).splitlines():
    line = line.strip()
    for lead in ("The actor died because ", "The actor is dead because "):
      if line.startswith(lead):
        return ": " + line[len(lead):].split(". ")[0].rstrip(".")
  return ""


def scaling_bounds(options: dict, num_workers: int) -> tuple:
  """`(min_workers, max_workers)` of `ray_options`, checked.

  Raises:
    ValueError: bounds that are not `1 <= min <= num_workers <= max`.

  Example:
    >>> from jdist._src.ps.ray_backend import scaling_bounds
    >>> scaling_bounds({"max_workers": 4}, num_workers=2), scaling_bounds({}, 2)
    ((1, 4), (1, 2))
  """
  low = options.get("min_workers", 1)
  high = options.get("max_workers", num_workers)
  for name, n in (("min_workers", low), ("max_workers", high)):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"ray_options[{name!r}] must be a positive integer, "
                       f"got {n!r}.")
  if not low <= num_workers <= high:
    raise ValueError(
        f"ray_options must have min_workers <= num_workers <= max_workers: "
        f"the cluster starts with its {num_workers} worker(s) (its "
        f"'worker' tasks), got min_workers={low}, max_workers={high}. Raise "
        "max_workers (workers that join later) or lower min_workers (the "
        "fewest the job goes on with).")
  return low, high


def _unwrap(error) -> BaseException:
  """The exception a function raised in a worker actor, with its traceback."""
  cause = getattr(error, "cause", None)
  if cause is None:
    return error
  if isinstance(cause, (WorkerFailedError, ParameterServerError)):
    return cause
  note = str(error)
  try:
    cause.add_note(f"Raised on a Ray worker:\n{note}")
  except AttributeError:
    pass
  return cause


class RayCluster:
  """Parameter-server and worker actors of a `ParameterServerStrategy`."""

  def __init__(self, spec, strategy, options: dict, timeout: float):
    ray = _ray()
    if not ray.is_initialized():
      ray.init()
    options = dict(options)
    self.min_workers, self.max_workers = scaling_bounds(options,
                                                        spec.num_workers)
    options.pop("min_workers", None)
    options.pop("max_workers", None)
    per_worker = int(options.pop("devices_per_worker", 1))
    worker_opts = dict(options.pop("worker", {}))
    ps_opts = dict(options.pop("ps", {}))
    if options:
      raise ValueError(f"Unknown ray_options {sorted(options)}; use 'worker', "
                       "'ps', 'devices_per_worker', 'min_workers' and "
                       "'max_workers'.")
    env = dict(worker_opts.pop("runtime_env", {}) or {})
    env_vars = dict(env.get("env_vars", {}))
    # A worker process sees its own devices, not the driver's fake ones.
    env_vars.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={per_worker}")
    env["env_vars"] = env_vars
    self._tag = uuid.uuid4().hex[:8]
    self._timeout = timeout
    server_cls = ray.remote(ParameterServer)
    self._servers = [server_cls.options(
        max_restarts=0, max_concurrency=self.max_workers + 2,
        num_cpus=ps_opts.pop("num_cpus", 0), **ps_opts).remote(i)
        for i in range(spec.num_ps)]
    # Health calls run in a thread of their own: a worker answers them while
    # it runs a function, and a silent one hangs.
    worker_cls = ray.remote(concurrency_groups={"health": 1})(TrainingWorker)
    strategy_bytes = _pickle().dumps(strategy)
    worker_opts.setdefault("max_restarts", -1)
    worker_opts.setdefault("num_cpus", 1)
    self._demand = _demand(worker_opts)
    # Every worker's input context counts max_workers pipelines: a worker's
    # index (its slot) is below it, whenever it joined.
    self._new_actor = lambda index: worker_cls.options(
        max_task_retries=0, runtime_env=env, **worker_opts).remote(
            index, self.max_workers, strategy_bytes)
    actors = [self._new_actor(i) for i in range(spec.num_workers)]
    self.store = RayStore(self._servers, spec.ps, timeout)
    self.workers = [RayWorker(i, a, timeout) for i, a in enumerate(actors)]
    self.replicas_per_worker = per_worker
    self._payloads = weakref.WeakKeyDictionary()
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._watcher = None
    self._candidate = None  # (index, actor, its first call) while it starts
    # Fail now, with Ray's message, if an actor cannot start.
    ray.get([s.ping.remote() for s in self._servers] +
            [a.ping.remote() for a in actors], timeout=max(timeout, 120))

  # --- workers that join and leave ---------------------------------------------

  def watch(self, on_join) -> None:
    """Starts the thread that adds workers while fewer than `max_workers` run
    and Ray's free resources fit one (`on_join(worker, where)` may refuse
    it)."""
    self._watcher = threading.Thread(target=self._watch, args=(on_join,),
                                     name="jdist-ray-workers", daemon=True)
    self._watcher.start()

  def left(self, worker) -> None:
    """`worker` died for good: its slot is free for a worker that joins."""
    with self._lock:
      if worker in self.workers:
        self.workers.remove(worker)
    try:
      _ray().kill(worker.actor, no_restart=True)
    except Exception:  # already gone
      pass

  def _watch(self, on_join) -> None:
    ray = _ray()
    while not self._stop.wait(_WATCH_EVERY):
      try:
        if self._candidate is None:
          self._start_candidate(ray)
        else:
          self._admit_candidate(ray, on_join)
      except Exception:  # Ray shutting down under us: stop watching
        if self._stop.is_set():
          return
        _log.exception("Watching the Ray cluster for new workers failed; "
                       "no more workers join.")
        return

  def _start_candidate(self, ray) -> None:
    with self._lock:
      used = {w.index for w in self.workers}
      if (len(used) >= self.max_workers or
          any(w.recovering for w in self.workers)):
        return  # full, or a restarting worker needs the free resources
    free = ray.available_resources()
    if any(free.get(k, 0.0) + 1e-9 < v for k, v in self._demand.items()):
      return
    index = min(set(range(self.max_workers)) - used)
    actor = self._new_actor(index)
    self._candidate = (index, actor, actor.where.remote())

  def _admit_candidate(self, ray, on_join) -> None:
    index, actor, first = self._candidate
    if not ray.wait([first], timeout=0)[0]:
      return  # still starting (or waiting for a node with room)
    self._candidate = None
    try:
      where = ray.get(first)
    except ray.exceptions.RayError as e:
      _log.warning("A new worker (slot %d) could not start: %s", index,
                   str(e).splitlines()[0] if str(e) else type(e).__name__)
      ray.kill(actor, no_restart=True)
      return
    worker = RayWorker(index, actor, self._timeout)
    with self._lock:
      if self._stop.is_set():
        accepted = False
      else:
        self.workers.append(worker)
        accepted = True
    if accepted and on_join(worker, where):
      return
    self.left(worker)

  def _pickled(self, obj, key=None) -> tuple:
    """`(key, bytes)` of `obj`, pickled once per object."""
    try:
      cached = self._payloads.get(obj)
    except TypeError:  # not weak-referenceable: pickled every time
      cached = None
    if cached is None:
      cached = (key or uuid.uuid4().hex, _pickle().dumps(obj))
      try:
        self._payloads[obj] = cached
      except TypeError:
        pass
    return cached

  def prepare(self, closure) -> None:
    """Pickles the closure: function and datasets once, arguments every time."""
    is_resource = lambda x: isinstance(x, worker_lib.PerWorkerResource)
    definitions = {}

    def ref(x):
      definitions[x.key] = self._pickled(x, x.key)[1]
      return worker_lib.ResourceRef(x.key)

    try:
      fn_key, fn_bytes = self._pickled(closure.fn)
      args = jax.tree.map(lambda x: ref(x) if is_resource(x) else x,
                          (closure.args, closure.kwargs), is_leaf=is_resource)
      args_bytes = _pickle().dumps(args)
    except Exception as e:
      raise TypeError(
          f"With backend='ray' a scheduled function and its arguments travel "
          f"to a worker process, so they must be picklable (cloudpickle): "
          f"{type(e).__name__}: {e}") from e
    closure.payload = (fn_key, fn_bytes, sorted(definitions.items()),
                       args_bytes)

  def close(self) -> None:
    ray = _ray()
    self._stop.set()
    if self._watcher is not None:
      self._watcher.join(60.0)
    self.store.close()
    with self._lock:
      actors = [w.actor for w in self.workers]
    if self._candidate is not None:
      actors.append(self._candidate[1])
      self._candidate = None
    for actor in actors + self._servers:
      try:
        ray.kill(actor, no_restart=True)
      except Exception:  # already gone
        pass
