"""Data: TFDS builders, tokenizer and the grain input pipeline."""
