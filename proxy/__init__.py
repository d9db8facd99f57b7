"""Inference Gateway: a policy-enforcing reverse proxy for GPU inference servers."""

__version__ = "0.1.0"
