"""Backend-specific kernels behind the model's attention, projections, dropout and loss, each
named by a concrete ModelConfig field (ModelConfig.resolved picks them per platform): kernels.py
the XLA:CPU-tuned projections and masks (matmul.py, dropout.py) or plain JAX;
attention_kernels.py the attention kernels (flash.py, cudnn.py, splash.py)."""
