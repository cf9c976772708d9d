"""Backend-specific kernels behind the model's attention, projections, dropout and loss, each
chosen by a ModelConfig field whose 'auto' resolves per platform (backend.py): kernels.py picks
the XLA:CPU-tuned projections and masks (matmul.py, dropout.py) or plain JAX;
attention_kernels.py the attention kernel (flash.py, cudnn.py, splash.py); output_loss.py,
fused_loss.py, residual_norm.py and ffn.py the loss, post-LN and FFN levers."""
