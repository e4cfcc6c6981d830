"""Export of cmoe_jax models for other tools (`python -m cmoe_jax.export`)."""
from cmoe_jax.export.api import EXPORT_MANIFEST, ExportError, ExportSettings, export

__all__ = ["export", "ExportSettings", "ExportError", "EXPORT_MANIFEST"]
