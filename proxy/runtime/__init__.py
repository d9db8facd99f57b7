"""Processes: master, workers, supervised backends, the embedded Redis, drain."""
