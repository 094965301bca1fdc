"""Measuring on the local device: per-unit profiles (profile.py) and spec calibration (calibrate.py)."""
