"""Evaluation and calibration data (WikiText-2, C4) in the GPTQ family's conventions."""
from cmoe_jax.data.text_sources import (C4_WINDOWS, DATASETS, DataError, load_text,
                                        load_text_tokens)
from cmoe_jax.data.windows import calibration_windows, text_windows

__all__ = ["C4_WINDOWS", "DATASETS", "DataError", "load_text", "load_text_tokens",
           "calibration_windows", "text_windows"]
