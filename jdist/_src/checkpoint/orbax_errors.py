"""orbax's failures, reduced to one message with its cause.

When a save or restore fails (a full disk, a corrupt file), orbax and
tensorstore report it many times over: an absl error with a traceback from
each of orbax's threads, the same exception again from every write still in
flight, "Task exception was never retrieved" for each orphaned asyncio task,
and, from tensorstore's threads, "RuntimeError: Event loop is closed" for
every read or write that completes after orbax closed its event loop. A full
disk printed about 500 lines, a failed restore about 20 of those tracebacks.

`summarised()` holds back orbax's error logs while a call runs. If the call
fails, it waits for orbax's threads to finish (they go on failing and
reporting after the first error), the caller raises (or warns) once with
`reason(e)`, and the held logs are dropped; if it succeeds, the held logs are
passed on as they were, so nothing is hidden from a call that worked.
asyncio's reports of the tasks a failed call left behind are dropped too, and
so are Python's "coroutine ... was never awaited" warnings for the coroutines
it abandoned (after a failure only: they arrive whenever the garbage collector
finds them, as late as interpreter exit). The late "Event loop is closed"
reports say only that a result nobody waits for anymore arrived; they are
dropped whenever they come. So are orbax's error logs, and asyncio's reports
of futures whose exception nobody retrieved, that name the files of a call
that failed (`summarised(path)`) and arrive after it returned: they come from
threads and garbage collection that the wait above cannot cover.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time
import warnings

_SPEC = re.compile(r"\s*\[(tensorstore_spec(\[\d+\])?|source locations|"
                   r"os_error_code)='.*?'\]", re.S)


def reason(e: BaseException, limit: int = 300) -> str:
  """What went wrong, in a line: without tensorstore's specs, cut to `limit`."""
  text = _SPEC.sub("", str(e)).split(" See full TensorStore details")[0]
  text = " ".join(text.split())
  if len(text) > limit:  # the cause (errno text, file) is at the end
    text = "..." + text[-limit:].split(" ", 1)[-1]
  return f"{type(e).__name__}: {text}"


def _orbax_code(unraisable) -> bool:
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and "orbax" in code.co_filename


def _is_noise(unraisable) -> bool:
  exc, tb = unraisable.exc_value, unraisable.exc_traceback
  if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and \
      tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
    return True  # called from tensorstore's threads, with no Python caller
  return _orbax_code(unraisable)  # a coroutine a failed call left behind


def _filtered_hook(previous):
  def hook(unraisable):
    if not _is_noise(unraisable):
      previous(unraisable)
  hook.jdist_filter = True
  return hook


class _Echoes(logging.Filter):
  """Drops orbax's error logs about the files of calls that failed."""

  def __init__(self):
    super().__init__()
    self.paths: set[str] = set()

  def names_failed_files(self, text: str) -> bool:
    return any(p in text for p in self.paths)

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or not self.names_failed_files(
        record.getMessage())


_ECHOES = _Echoes()


class _Orphans(logging.Filter):
  """Drops asyncio's reports of the tasks and futures a failed orbax call left
  behind (a future's report names the files, not orbax)."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return not (("never retrieved" in text or "destroyed but it is pending"
                 in text) and ("orbax" in text or
                               _ECHOES.names_failed_files(text)))


_ORPHANS = _Orphans()


def _install() -> None:
  if not getattr(sys.unraisablehook, "jdist_filter", False):
    sys.unraisablehook = _filtered_hook(sys.unraisablehook)
  asyncio_logger = logging.getLogger("asyncio")
  if _ORPHANS not in asyncio_logger.filters:
    asyncio_logger.addFilter(_ORPHANS)


class _Hold(logging.Filter):
  def __init__(self):
    super().__init__()
    self.records: list[logging.LogRecord] = []

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR:
      self.records.append(record)
      return False
    return True


def _join_orbax_threads(timeout: float = 30.0) -> None:
  """Waits for the threads of a failed orbax call, which go on reporting."""
  deadline = time.monotonic() + timeout
  for thread in threading.enumerate():
    if type(thread).__module__.startswith("orbax") and \
        thread is not threading.current_thread():
      thread.join(max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def summarised(path: str | None = None):
  """Holds orbax's error reports while a call runs; see the module docstring.

  Args:
    path: the files the call reads or writes; if it fails, orbax's later
      error logs that name them are dropped too.
  """
  _install()
  hold = _Hold()
  absl = logging.getLogger("absl")
  absl.addFilter(hold)
  ok = False
  try:
    yield
    ok = True
  finally:
    if not ok:
      if path is not None:
        _ECHOES.paths.add(str(path))
        if _ECHOES not in absl.filters:
          absl.addFilter(_ECHOES)
      _join_orbax_threads()
      warnings.filterwarnings("ignore", message=r"coroutine '.*' was never "
                              "awaited", category=RuntimeWarning)
    absl.removeFilter(hold)
    if ok:
      for record in hold.records:
        absl.handle(record)
