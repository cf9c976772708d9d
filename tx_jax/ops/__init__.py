"""Backend-specific kernels behind the model's projections and dropout (tuned for XLA:CPU)."""
