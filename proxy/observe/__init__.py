"""What the gateway tells operators: metrics, the access log."""
