"""Evaluation: corpus metrics, predictions, probes, zero-shot, lm-eval, and inference on a trained run."""
