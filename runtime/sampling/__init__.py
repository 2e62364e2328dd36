"""Sampling: per-request parameters, the host and device samplers, stop strings and logits processors."""
