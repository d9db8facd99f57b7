"""The media stack of tests/families (gateway + simulators + audio host), for async tasks."""

from tests.families.conftest import media

__all__ = ["media"]
