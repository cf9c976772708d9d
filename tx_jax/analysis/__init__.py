"""Analysis of models and runs: representation similarity, plots, FLOP counts."""
