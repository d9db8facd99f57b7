"""How a request ended: set by the relay and the pipeline, read by metering and the journal."""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    COMPLETED = "completed"  # the whole answer reached the client
    CUT = "cut"  # the upstream closed a stream early
    TIMEOUT = "timeout"  # the upstream went silent
    FAILED = "failed"  # the upstream reported an error, or the request failed before it ran
    CLIENT_GONE = "client_gone"  # the client closed its connection
    UPSTREAM_ERROR = "upstream_error"  # the upstream failed, or its answer was unusable
    CLIENT_ERROR = "client_error"  # refused once running: the client's own fault (a 4xx: a URL
    # that cannot be fetched, audio too long, a request the engine refused)
    REPLAYED = "replayed"  # an idempotent retry: the stored result again, nothing ran
