"""orbax's failures, reduced to one message with its cause.

orbax and tensorstore report a failure many times over, from many threads.
`summarised()` holds orbax's error logs while a call runs; if it fails, the
held logs and later echoes of the failed call are dropped and the caller
raises once with `reason(e)`; if it succeeds, the logs are passed on.
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
  """Drops asyncio's reports of the tasks and futures a failed call left."""

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
  """Holds orbax's error reports while a call runs; `path`: the files it
  uses, whose later error logs are dropped if it fails."""
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
