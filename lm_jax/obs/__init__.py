"""Observability: where a run's time, memory and records go (goodput, profiles, metrics, W&B, plots)."""
