"""Orbax's failures as the project's one-line errors.

Two things Orbax does not do for us:
- a full disk (or a read-only one) inside an Orbax write surfaces as a ValueError from
  tensorstore (`RESOURCE_EXHAUSTED: ... Failed writing: "...": No space left on device
  [os_error_code='28']`) plus a logged traceback from its writer thread; `orbax_writes`
  turns it into the OSError it is, naming the checkpoint being written, which `run_job`
  prints as one line;
- when one read of a restore fails, Orbax closes its event loop while tensorstore's other
  reads are still in flight; each then calls back into the closed loop and prints an "Event
  loop is closed" traceback. `drain_orbax_loops` makes its loop wait for them first.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

from orbax.checkpoint._src import asyncio_utils

from cmoe_jax.errors import PLACE_ERRORS

_OS_ERROR_CODE = re.compile(r"\[os_error_code='(\d+)'\]")
_orbax_log = logging.getLogger("absl")
DRAIN_SECONDS = 60.0


def os_error_of(error: BaseException, path: Path) -> OSError | None:
    """The OSError of the environment inside a tensorstore error (`[os_error_code='N']`;
    without a code, `RESOURCE_EXHAUSTED` is a full disk and `Failed writing` an I/O error),
    with `path` as its filename; None for any other error."""
    text = str(error)
    found = _OS_ERROR_CODE.search(text)
    code = (int(found.group(1)) if found else errno.ENOSPC if "RESOURCE_EXHAUSTED" in text
            else errno.EIO if "Failed writing" in text else None)
    if code not in PLACE_ERRORS:
        return None
    return OSError(code, os.strerror(code), str(path))


class _QuietWriterThreads(logging.Filter):
    """Drop the tracebacks Orbax's writer threads log as they fail: the same error reaches
    the caller, raised from the save."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.exc_info and "raised an exception" not in record.getMessage()


@contextmanager
def orbax_writes(path: Path):
    """Around an Orbax save of `path`: the environment's refusal (disk full, read-only,
    permission) raised as an OSError naming `path` (the file when it names one), any other
    error unchanged."""
    quiet = _QuietWriterThreads()
    _orbax_log.addFilter(quiet)
    try:
        yield
    except ValueError as e:
        refused = os_error_of(e, path)
        if refused is None:
            raise
        raise refused from None
    except OSError as e:  # Orbax's own small files (metadata) fail as plain OSErrors, no path
        if e.filename is None and e.errno in PLACE_ERRORS:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    finally:
        _orbax_log.removeFilter(quiet)


def _run_sync_draining(coro):
    """Orbax's `_run_sync_via_new_loop`, except that the loop closes only once the tasks it
    started have ended (tensorstore's reads resolve their futures through the loop), or
    after `DRAIN_SECONDS` (a task that never ends is closed with the loop, as before)."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        pending = asyncio.all_tasks(loop)
        if pending:
            done, _ = loop.run_until_complete(asyncio.wait(pending, timeout=DRAIN_SECONDS))
            for task in done:  # their errors are the one raised or its siblings: seen, not logged
                if not task.cancelled():
                    task.exception()
        asyncio.set_event_loop(None)
        loop.close()


def drain_orbax_loops() -> None:
    """Install `_run_sync_draining` in Orbax (idempotent; a no-op if Orbax changed its runner)."""
    if hasattr(asyncio_utils, "_run_sync_via_new_loop"):
        asyncio_utils._run_sync_via_new_loop = _run_sync_draining


drain_orbax_loops()
