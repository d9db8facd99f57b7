"""Session fixtures: real encoder output (tests/support/encoded_media.py), one test per format."""

from __future__ import annotations

import pytest

from tests.support.encoded_media import AUDIO_FORMATS, VIDEO_FORMATS, Encoded, audio_clip, videos_in


@pytest.fixture(scope="session", params=list(AUDIO_FORMATS))
def encoded_audio(request: pytest.FixtureRequest) -> Encoded:
    """The 3 s 16 kHz mono tone, encoded to each audio format by FFmpeg's own muxers."""
    fmt: str = request.param
    return audio_clip(fmt)


@pytest.fixture(scope="session", params=list(VIDEO_FORMATS))
def encoded_videos(request: pytest.FixtureRequest) -> tuple[Encoded, ...]:
    """The 2 s test video in each container, once per codec the PyAV wheel has for it."""
    fmt: str = request.param
    return videos_in(fmt)
