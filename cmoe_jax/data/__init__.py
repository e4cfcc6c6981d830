"""Evaluation and calibration data (WikiText-2, C4) in the GPTQ family's conventions."""
from cmoe_jax.data.calibration import Calibration
from cmoe_jax.data.text_sources import (C4_DOCUMENTS, C4_WINDOWS, DATASETS, SOURCES, DataError,
                                        check_download, default_split, join_items, load_items,
                                        load_text, load_text_tokens)
from cmoe_jax.data.windows import (calibration_windows, eval_windows, held_out_windows, length_bucket,
                                   text_windows)

__all__ = ["Calibration", "C4_DOCUMENTS", "C4_WINDOWS", "DATASETS", "SOURCES", "DataError", "check_download",
           "default_split", "join_items", "load_items", "load_text", "load_text_tokens", "calibration_windows",
           "eval_windows", "held_out_windows", "length_bucket", "text_windows"]
