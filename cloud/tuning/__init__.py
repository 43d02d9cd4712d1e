"""Tuning: measure each model per backend, threads and batch size; fit ``l(b)``;
pick the best configuration under a latency objective (``ferry-cloud tune``)."""
