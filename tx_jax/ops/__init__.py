"""Backend-specific kernels behind the model's projections and dropout: kernels.py picks the
XLA:CPU-tuned ones (matmul.py, dropout.py) or plain JAX by `ModelConfig.kernels`."""
