"""Placeholder: the upstream fleet (health checks, supervision) is being written (issue 5)."""

from __future__ import annotations

from aiohttp import web


def setup_fleet(app: web.Application) -> None:
    """Health loop and fleet admin routes for this worker (cleanup_ctx + routes)."""
