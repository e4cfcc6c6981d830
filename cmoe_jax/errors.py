"""Errors users see: one class per kind of bad input, each message says what to do."""
import errno
import importlib
import sys


class CmoeError(Exception):
    """Base class for user-facing errors (the CLIs print these as one line and exit 2)."""


class UnsupportedModelError(CmoeError):
    """The checkpoint's `model_type` is not one of the supported decoder families."""


class CheckpointError(CmoeError):
    """A checkpoint file is missing, corrupted, truncated, or does not match its config."""


class InputError(CmoeError, ValueError):
    """A value given by the user (a plan, a request, a prompt) that cannot be used; still a
    ValueError for callers of the library API that catch those."""


class MissingDependencyError(CmoeError):
    """An optional dependency is not installed; the message names the extra that brings it."""


class TrainError(CmoeError):
    """Bad fine-tuning input: unknown LoRA targets, a mismatched resume directory, short data."""


def require(module: str, extra: str, purpose: str):
    """Import an optional dependency, or raise a one-line error naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(f"{purpose} needs the Python package {module.split('.')[0]!r}, "
                                     f"which is not installed: pip install -e '.[{extra}]' (in the checkout)") from None


_NOTED: set[tuple[str, str]] = set()


def optional(module: str, extra: str, purpose: str):
    """Import an optional dependency, or return None after one `note:` line on stderr (once
    per package and purpose in a process) saying that `purpose` is skipped and which extra
    brings the package."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        if (package, purpose) not in _NOTED:
            _NOTED.add((package, purpose))
            print(f"note: {purpose} skipped: the Python package {package!r} is not installed "
                  f"(pip install -e '.[{extra}]' in the checkout)", file=sys.stderr)
        return None


EXIT_BAD_INPUT = 2

# what the environment refuses, with what to do about it (any other OSError is a bug)
PLACE_ERRORS = {
    errno.ENOSPC: "free some space", errno.EDQUOT: "free some space within the quota",
    errno.EROFS: "choose a writable place", errno.EACCES: "choose a place you may write",
    errno.EPERM: "choose a place you may write", errno.EBUSY: "choose a path that is not in use",
    errno.EIO: "check the disk",
}


def place_error(e: OSError) -> str:
    """One line for an OSError of the environment (disk full, read-only, refused)."""
    where = f" at {e.filename}" if e.filename else ""
    return (f"{e.strerror or errno.errorcode.get(e.errno, 'I/O error')}{where}: "
            f"{PLACE_ERRORS[e.errno]}, then rerun (a job with --resume continues from whatever "
            "work it had staged, if any)")


def run_job(job, args):
    """`(job(args), 0)`, or `(None, 2)` after printing a user error as one `error:` line.

    The CLIs share this so every bad input reads the same way and exits non-zero. The
    project's own errors (`CmoeError`) and what the environment refuses (an OSError of
    `PLACE_ERRORS`: disk full, read-only, permission, busy) are one line; anything else is a
    bug and keeps its traceback.
    """
    try:
        return job(args), 0
    except CmoeError as e:
        message = " ".join(str(e).split()) or type(e).__name__
    except OSError as e:
        if e.errno not in PLACE_ERRORS:
            raise
        message = " ".join(place_error(e).split())
    _end_progress_bars()
    print(f"error: {message}", file=sys.stderr)
    return None, EXIT_BAD_INPUT


def _end_progress_bars() -> None:
    """Close the progress bars an error left open, so the `error:` line starts a line of its own
    (tqdm, when a job imported it, keeps its live bars in `tqdm._instances`)."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
