"""The rendezvous over TCP: one connection per node, one JSON line per
request; a node whose connection closes has gone away.

Example:
  >>> from jdist._src.launcher import rendezvous, rendezvous_tcp
  >>> spec = rendezvous.JobSpec(1, 1, 0, ("train.py",))
  >>> server = rendezvous_tcp.Server(rendezvous.Rendezvous(spec), "127.0.0.1", 0)
  >>> client = rendezvous_tcp.Client(*server.address, timeout=10)
  >>> client.hello(spec.asdict(), nproc=1) == 0
  True
  >>> client.request("join", port=1234)["run"]["coordinator"]
  '127.0.0.1:1234'
  >>> client.close(); server.close(linger=0)
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time

from jdist._src.launcher import rendezvous

TICK_SECONDS = 0.5
WAIT_SECONDS = 1.0      # a "view" request waits this long for a change of phase
REQUEST_SECONDS = 60.0  # a rendezvous that does not answer a request this long is gone


class RendezvousError(Exception):
  """The rendezvous refused this node, or can no longer be reached."""


class Server:
  """Serves `state` on `host:port` (port 0: a free one; see `address`)."""

  def __init__(self, state: rendezvous.Rendezvous, host: str, port: int):
    self.state = state
    self._sock = socket.create_server((host, port))
    self.address = self._sock.getsockname()[:2]
    self._lock = threading.Lock()
    self._changed = threading.Condition(self._lock)
    self._closed = threading.Event()
    self._connections: set[socket.socket] = set()
    self._threads = [threading.Thread(target=target, name="jdist-rendezvous",
                                      daemon=True)
                     for target in (self._accept, self._tick)]
    for thread in self._threads:
      thread.start()

  @classmethod
  def host_if_local(cls, state, host: str, port: int) -> "Server | None":
    """A server on `host:port` if that address is this machine's and free."""
    try:
      return cls(state, host, port)
    except OSError as e:
      if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        return None  # another launcher hosts it, or another machine does
      raise

  def _accept(self) -> None:
    while not self._closed.is_set():
      try:
        conn, _ = self._sock.accept()
      except OSError:
        return
      with self._lock:
        self._connections.add(conn)
      thread = threading.Thread(target=self._serve, args=(conn,),
                                name="jdist-rendezvous-node", daemon=True)
      self._threads.append(thread)
      thread.start()

  def _tick(self) -> None:
    while not self._closed.wait(TICK_SECONDS):
      with self._lock:
        self.state.advance()
        self._changed.notify_all()

  def _serve(self, conn: socket.socket) -> None:
    member = None
    with conn, conn.makefile("rwb") as f:
      try:
        for line in f:
          request = json.loads(line)
          with self._lock:
            reply = self._handle(member, request, conn)
            self._changed.notify_all()
          member = reply.get("member", member)
          f.write(json.dumps(reply).encode() + b"\n")
          f.flush()
      except (OSError, ValueError):
        pass
      finally:
        with self._lock:
          self._connections.discard(conn)
          if member is not None:
            self.state.leave(member, "its launcher's connection closed")

  def _handle(self, member, request: dict, conn) -> dict:
    op = request.pop("op", None)
    if op == "hello":
      address = request.pop("address", None) or conn.getpeername()[0]
      return self.state.hello(request["spec"], address, request["nproc"])
    if member is None:
      return {"error": "say hello first"}
    self.state.heard(member)
    if op == "leave":
      self.state.leave(member, request.get("why", "it left"))
      return {}
    if op == "view" and request.get("since") is not None:
      # Answers at the next change of phase (or after WAIT_SECONDS): a node
      # between attempts learns at once that the next one runs.
      since = request.pop("since")
      self._changed.wait_for(lambda: self.state.version != since, WAIT_SECONDS)
    handlers = {"join": self.state.join, "poll": self.state.poll,
                "finish": self.state.finish, "view": self.state.view}
    if op not in handlers:
      return {"error": f"unknown request {op!r}"}
    return handlers[op](member, **request)

  def close(self, linger: float) -> None:
    """Stops serving once no node needs it, waiting at most `linger` s."""
    deadline = time.monotonic() + linger
    while time.monotonic() < deadline:
      with self._lock:
        if self.state.unneeded():
          break
      time.sleep(0.05)
    self._closed.set()
    with self._lock:
      sockets = [self._sock, *self._connections]
    for sock in sockets:
      # shutdown, not only close: a thread blocked in accept() or a read on
      # Linux wakes only on shutdown.
      for end in (lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
        try:
          end()
        except OSError:
          pass
    for thread in self._threads[:2]:  # accept and tick: no new threads after
      thread.join(timeout=5)
    for thread in self._threads[2:]:
      thread.join(timeout=5)


class Client:
  """One node's connection to the rendezvous, tried for `timeout` seconds."""

  def __init__(self, host: str, port: int, *, timeout: float):
    self.endpoint = f"{host}:{port}"
    deadline = time.monotonic() + timeout
    while True:
      try:
        self._sock = socket.create_connection((host, port), timeout=5)
        break
      except OSError as e:
        if time.monotonic() >= deadline:
          raise RendezvousError(
              f"cannot reach the rendezvous at {self.endpoint} ({e}) within "
              f"{timeout:g} s: start the launcher whose machine has that "
              "address, with the same --rdzv-endpoint.") from e
        time.sleep(0.2)
    self._sock.settimeout(REQUEST_SECONDS)
    self._file = self._sock.makefile("rwb")
    self.local_address = self._sock.getsockname()[0]

  def hello(self, spec: dict, *, nproc: int) -> int:
    reply = self.request("hello", spec=spec, nproc=nproc,
                         address=self.local_address)
    return reply["member"]

  def request(self, op: str, **payload) -> dict:
    """Sends one request; returns the reply (raises `RendezvousError`)."""
    try:
      self._file.write(json.dumps({"op": op, **payload}).encode() + b"\n")
      self._file.flush()
      line = self._file.readline()
    except OSError as e:
      raise RendezvousError(self._lost(e)) from e
    if not line:
      raise RendezvousError(self._lost("the connection closed"))
    reply = json.loads(line)
    if "error" in reply:
      raise RendezvousError(f"the rendezvous at {self.endpoint} refused this "
                            f"node: {reply['error']}")
    return reply

  def _lost(self, why) -> str:
    return (f"lost the rendezvous at {self.endpoint} ({why}): the launcher "
            "that hosts it ended, so the job cannot go on.")

  def close(self) -> None:
    for closable in (self._file, self._sock):
      try:
        closable.close()
      except OSError:
        pass
