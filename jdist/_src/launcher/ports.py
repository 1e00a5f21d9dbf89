"""Whether a coordinator port is free, checked before anything starts.

JAX's gRPC coordinator sets `SO_REUSEPORT`, so a second job's coordinator on
a busy port shares it and both jobs break; the port is bound first without
it, and a busy one refused with a message.
"""

from __future__ import annotations

import errno
import os
import socket

# Where JAX's coordinator binds by default: every interface ([::]:port).
BIND_ENV = "JAX_COORDINATOR_BIND_ADDRESS"


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on `host` right now."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def bind_address(port: int) -> str:
  """The address process 0's coordinator will bind for `port` (JAX's rule)."""
  return os.environ.get(BIND_ENV) or f"[::]:{port}"


def in_use(address: str) -> OSError | None:
  """The error of binding `address` ("host:port", "[::]:port") if it is in
  use, else None (TIME_WAIT does not count).

  Example:
    >>> import socket
    >>> from jdist._src.launcher import ports
    >>> with socket.socket() as s:
    ...   s.bind(("127.0.0.1", 0)); s.listen()
    ...   port = s.getsockname()[1]
    ...   busy = ports.in_use(f"127.0.0.1:{port}")
    >>> busy is not None, ports.in_use(f"127.0.0.1:{port}")
    (True, None)
  """
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  if host in ("", "::", "0.0.0.0"):  # every interface: IPv6 and IPv4, else IPv4
    targets = [(socket.AF_INET6, ("::", int(port))),
               (socket.AF_INET, ("0.0.0.0", int(port)))]
  else:
    targets = [(family, sockaddr) for family, _, _, _, sockaddr in
               socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)][:1]
  for family, sockaddr in targets:
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and sockaddr[0] == "::":
          s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(sockaddr)
      return None
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        return e
  return None
