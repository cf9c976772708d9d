"""Inference on a trained checkpoint: restore, average, decode, evaluate, translate."""
