"""Whether a process of this machine still exists, by its pid."""

from __future__ import annotations

import os


def pid_exists(pid) -> bool:
  """Whether a process with this pid exists on this machine (another user's
  and a zombie count; 0 and negative numbers never do).

  Example:
    >>> import os
    >>> from jdist._src.launcher.liveness import pid_exists
    >>> pid_exists(os.getpid()), pid_exists(0)
    (True, False)
  """
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # another user's process: it exists
  return True
