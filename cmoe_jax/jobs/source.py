"""The source model of a job, opened once: its config, its tokenizer (loaded once, or a
one-line error when the job needs one), its weights when asked, and its fingerprint."""
from __future__ import annotations

from pathlib import Path

from cmoe_jax.errors import CmoeError
from cmoe_jax.jobs.fingerprint import source_files
from cmoe_jax.loading import load_model, load_tokenizer, open_model


class MissingTokenizerError(CmoeError):
    """The job needs a tokenizer and the checkpoint ships none."""


class SourceModel:
    """`SourceModel(name)`: config read now (a GGUF file is parsed once for the whole job)."""

    _UNSET = object()

    def __init__(self, name: str):
        self.name = str(name)
        self.config, self.path, self.source = open_model(self.name)
        self._tokenizer = self._UNSET

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer or None, loaded on first use only."""
        if self._tokenizer is self._UNSET:
            reader = getattr(self.source, "reader", None)
            self._tokenizer = load_tokenizer(getattr(self.source, "path", self.path), gguf_reader=reader)
        return self._tokenizer

    def require_tokenizer(self, why: str, hint: str = ""):
        """The tokenizer, or a one-line error: `{path} has no tokenizer: {why}`."""
        if self.tokenizer is None:
            raise MissingTokenizerError(f"{self.path} has no tokenizer: {why}{hint}")
        return self.tokenizer

    def load(self, **kw):
        """The weights (`load_model`), reusing this job's tokenizer and parsed source."""
        return load_model(self.name, tokenizer=self.tokenizer, opened=(self.config, self.path, self.source), **kw)

    def files(self) -> dict:
        return source_files(Path(self.path))
