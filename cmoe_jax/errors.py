"""Errors users see: one class per kind of bad input, each message says what to do."""


class CmoeError(Exception):
    """Base class for user-facing errors (the CLIs print these as one line and exit 2)."""


class UnsupportedModelError(CmoeError):
    """The checkpoint's `model_type` is not one of the supported decoder families."""


class CheckpointError(CmoeError):
    """A checkpoint file is missing, corrupted, truncated, or does not match its config."""
