"""Quantized weights: checkpoints' formats read into one canonical form, and the linear
layers that compute on it."""
