"""Corpora, calibration sets and the acceptance scenarios."""
