"""Real encoder output, made in-process with PyAV (its wheels bundle FFmpeg and its codecs).

The hand-built files in media_builders.py pin the parsers' edge cases; these are what real encoders
write (LAME/Xing tags, edit lists, Opus pre-skip, Cues and SeekHeads...), so the probes are
checked against FFmpeg's own muxers and, through PyAV's demuxers, against FFmpeg's readings.
Everything is encoded once per session and kept in memory (a few dozen kilobytes);
tests/media/conftest.py serves it as fixtures, other test packages call audio_clip().
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass

import av
import numpy as np
import pytest

TONE_RATE, TONE_SECONDS, TONE_HZ = 16000, 3.0, 440.0
VIDEO_FPS, VIDEO_FRAMES, VIDEO_SIZE = 6, 12, (64, 48)  # 2.0 s
VIDEO_SECONDS = VIDEO_FRAMES / VIDEO_FPS

# The proxy's format name -> (FFmpeg muxer, encoders by preference). The first encoder the
# PyAV wheel has is used; a format is missing only if the wheel has none of its encoders.
AUDIO_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mp3": ("mp3", ("libmp3lame", "libshine")),
    "flac": ("flac", ("flac",)),
    "m4a": ("ipod", ("aac", "libfdk_aac")),
    "ogg": ("ogg", ("libopus", "libvorbis", "flac")),
    "webm": ("webm", ("libopus", "libvorbis")),
    "wav": ("wav", ("pcm_s16le",)),
}
# Every available encoder is used here: a container is checked with each codec it can carry.
VIDEO_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mp4": ("mp4", ("libx264", "mpeg4")),
    "webm": ("webm", ("libvpx", "libvpx-vp9")),
}


@dataclass(frozen=True, slots=True)
class Encoded:
    format: str  # as proxy.media names it
    muxer: str  # FFmpeg's container
    codec: str  # FFmpeg's encoder
    data: bytes


@dataclass(frozen=True, slots=True)
class AudioReading:
    """What PyAV (FFmpeg) makes of an audio file."""

    duration_s: float  # the container's duration, as ffprobe's format.duration
    decoded_s: float  # samples the decoder returns, over its rate
    channels: int


@dataclass(frozen=True, slots=True)
class VideoReading:
    duration_s: float
    frames: int
    size: tuple[int, int]


def encoder(candidates: Sequence[str]) -> str | None:
    """The first of these encoders the PyAV wheel has (checked against av.codecs_available)."""
    for name in candidates:
        if name in av.codecs_available:
            try:
                av.Codec(name, "w")
            except av.codec.codec.UnknownCodecError:  # a decoder by that name, no encoder
                continue
            return name
    return None


def tone() -> np.ndarray:
    t = np.arange(round(TONE_SECONDS * TONE_RATE)) / TONE_RATE
    return np.round(np.sin(2 * np.pi * TONE_HZ * t) * 12000).astype("<i2")


def encode_audio(muxer: str, codec: str, pcm: np.ndarray, rate: int = TONE_RATE) -> bytes:
    """Mono 16-bit `pcm` through `codec` into `muxer`, written to a seekable buffer (so the
    muxers finish their headers: Xing/LAME, moov, Matroska Duration and Cues)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "mono"
        for start in range(0, len(pcm), 1000):  # PyAV re-frames to the codec's frame size
            chunk = pcm[start : start + 1000]
            frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, start
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def encode_video(muxer: str, codec: str) -> bytes:
    """VIDEO_FRAMES flat grey frames, a step brighter each, at VIDEO_FPS."""
    width, height = VIDEO_SIZE
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as out:
        stream = out.add_stream(codec, rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(VIDEO_FRAMES):
            image = np.full((height, width, 3), 20 * i, np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


@functools.cache
def audio_clips() -> dict[str, Encoded]:
    """The 3 s 16 kHz mono tone in every audio format the wheel can write, by format."""
    pcm = tone()
    clips = {}
    for fmt, (muxer, candidates) in AUDIO_FORMATS.items():
        codec = encoder(candidates)
        if codec is not None:
            clips[fmt] = Encoded(fmt, muxer, codec, encode_audio(muxer, codec, pcm))
    return clips


@functools.cache
def video_clips() -> tuple[Encoded, ...]:
    """The 2 s test video in each container with each of its available codecs."""
    return tuple(Encoded(fmt, muxer, codec, encode_video(muxer, codec))
                 for fmt, (muxer, candidates) in VIDEO_FORMATS.items()
                 for codec in candidates if encoder([codec]))


def audio_clip(fmt: str) -> Encoded:
    """The encoded tone in `fmt`; skips only if the PyAV wheel has no encoder for it at all."""
    clip = audio_clips().get(fmt)
    if clip is None:
        pytest.fail(f"this PyAV wheel has none of {AUDIO_FORMATS[fmt][1]}")
    return clip


def videos_in(fmt: str) -> tuple[Encoded, ...]:
    """The test video in `fmt` with each available codec; skips only if there is none."""
    clips = tuple(c for c in video_clips() if c.format == fmt)
    if not clips:
        pytest.fail(f"this PyAV wheel has none of {VIDEO_FORMATS[fmt][1]}")
    return clips


def read_audio(data: bytes) -> AudioReading:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        if container.duration is not None:
            duration = container.duration / av.time_base
        else:
            assert stream.duration is not None and stream.time_base is not None
            duration = float(stream.duration * stream.time_base)
        samples, rate = 0, 0
        for frame in container.decode(stream):
            samples, rate = samples + frame.samples, frame.sample_rate
        return AudioReading(duration, samples / rate, stream.codec_context.channels)


def read_video(data: bytes) -> VideoReading:
    with av.open(io.BytesIO(data)) as container:
        assert container.duration is not None
        frames = list(container.decode(video=0))
        return VideoReading(container.duration / av.time_base, len(frames),
                            (frames[0].width, frames[0].height))

