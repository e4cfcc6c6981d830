"""Calibration passes: activation markers and the one layer-by-layer pass every method uses."""
