"""Upstream servers: backend pools, picking, and the pooled HTTP client."""
