"""Readers for RIFF and ISO-BMFF (MP4/M4A) containers, shared by audio and video, and what the
container readers share (Matroska/WebM's is matroska.py): `Malformed`, what they learn, the
length FFmpeg decodes where a container overstates it, Opus packet sizes.

They read hostile bytes: loops are bounded by counts or by forward progress, nothing recurses,
and every structural fault is `Malformed` (never IndexError or struct.error); the callers turn
it into their own NotAudio / NotMedia.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

MAX_CHUNKS = 10_000  # RIFF chunks per list
MAX_BOXES = 10_000  # MP4 boxes per level


class Malformed(ValueError):
    """A container's structure is broken; the message is safe to show a client."""


@dataclass(frozen=True, slots=True)
class Container:
    """What an MP4 or Matroska/WebM reader learned; None where the file does not say."""

    duration_s: float | None
    sample_rate: int | None
    channels: int | None


@dataclass(frozen=True, slots=True)
class Decoded:
    """What FFmpeg's decoder puts out of an audio stream: `seconds` of it, at `rate` Hz."""

    seconds: float
    rate: int


def uint(data: bytes, off: int, n: int, order: Literal["big", "little"] = "big") -> int:
    """`n` bytes at `off` as an unsigned int; `Malformed` if they run past the end."""
    if off < 0 or off + n > len(data):
        raise Malformed("truncated")
    return int.from_bytes(data[off : off + n], order)


def riff_chunks(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(id, body start, declared size) of each RIFF chunk in [start, end).

    The size is as written (it may be a placeholder or run past the end: the caller decides);
    the walk pads odd sizes to even and stops after `MAX_CHUNKS`.
    """
    pos = start
    for _ in range(MAX_CHUNKS):
        if pos + 8 > end:
            return
        size = uint(data, pos + 4, 4, "little")
        yield data[pos : pos + 4], pos + 8, size
        pos += 8 + size + (size & 1)


def opus_samples(packet: bytes) -> int:
    """48 kHz samples in an Opus packet, from its TOC byte (RFC 6716 §3.1)."""
    if not packet:
        return 0
    config, code = packet[0] >> 3, packet[0] & 3
    if config < 12:  # SILK: 10, 20, 40, 60 ms
        size = (480, 960, 1920, 2880)[config % 4]
    elif config < 16:  # hybrid: 10, 20 ms
        size = (480, 960)[config % 2]
    else:  # CELT: 2.5, 5, 10, 20 ms
        size = (120, 240, 480, 960)[config % 4]
    if code == 0:
        return size
    if code in (1, 2):
        return 2 * size
    return size * (packet[1] & 0x3F) if len(packet) > 1 else 0


# --- MP4 (ISO-BMFF) -------------------------------------------------------------------------


def mp4_boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, body start, body end) of each box in [start, end); a cut-off box is clamped."""
    pos = start
    for _ in range(MAX_BOXES):
        if pos + 8 > end:
            return
        size, kind, header = uint(data, pos, 4), data[pos + 4 : pos + 8], 8
        if size == 1:  # a 64-bit size follows the type
            size, header = uint(data, pos + 8, 8), 16
        elif size == 0:  # the box runs to the end of its parent
            size = end - pos
        if size < header:
            raise Malformed(f"MP4 box {kind!r} has an impossible size")
        yield kind, pos + header, min(pos + size, end)
        pos += size
    raise Malformed("too many MP4 boxes")


def _mp4_child(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    for found, body, body_end in mp4_boxes(data, start, end):
        if found == kind:
            return body, body_end
    return None


def mp4_path(data: bytes, start: int, end: int, *path: bytes) -> tuple[int, int] | None:
    span: tuple[int, int] | None = (start, end)
    for kind in path:
        if span is None:
            return None
        span = _mp4_child(data, span[0], span[1], kind)
    return span


def _mp4_duration(data: bytes, moov: tuple[int, int]) -> float | None:
    mvhd = _mp4_child(data, *moov, b"mvhd")
    if mvhd is None:
        raise Malformed("MP4 has no mvhd box")
    body = mvhd[0]
    wide = uint(data, body, 1) == 1  # version 1: 64-bit times
    scale = uint(data, body + (20 if wide else 12), 4)
    duration = uint(data, body + (24 if wide else 16), 8 if wide else 4)
    if scale == 0:
        raise Malformed("MP4 timescale is 0")
    if duration == (1 << (64 if wide else 32)) - 1:
        return None  # all ones: unknown
    if duration == 0:
        # Fragmented files may carry the total in moov/mvex/mehd; otherwise it is unknown.
        mehd = mp4_path(data, *moov, b"mvex", b"mehd")
        if mehd is None:
            return None if _mp4_child(data, *moov, b"mvex") else 0.0
        wide = uint(data, mehd[0], 1) == 1
        duration = uint(data, mehd[0] + 4, 8 if wide else 4)
    return duration / scale


def _sound_traks(data: bytes, moov: tuple[int, int]) -> Iterator[tuple[int, int]]:
    """The body spans of the sound tracks (handler `soun`) in moov, in order."""
    for kind, body, end in mp4_boxes(data, *moov):
        hdlr = mp4_path(data, body, end, b"mdia", b"hdlr") if kind == b"trak" else None
        if hdlr is not None and data[hdlr[0] + 8 : hdlr[0] + 12] == b"soun":
            yield body, end


def _mp4_audio(data: bytes, moov: tuple[int, int]) -> tuple[int | None, int | None]:
    """(sample rate, channels) of the first sound track's first sample entry."""
    for trak in _sound_traks(data, moov):
        stsd = mp4_path(data, *trak, b"mdia", b"minf", b"stbl", b"stsd")
        if stsd is None:
            continue
        for _, entry, _ in mp4_boxes(data, stsd[0] + 8, stsd[1]):
            # AudioSampleEntry: channel count at 16, 16.16 fixed-point sample rate at 24.
            return uint(data, entry + 24, 4) >> 16 or None, uint(data, entry + 16, 2) or None
    return None, None


def read_mp4(data: bytes) -> Container:
    """Duration (moov/mvhd) and the first sound track's format of an ISO-BMFF file."""
    moov = _mp4_child(data, 0, len(data), b"moov")
    if moov is None:
        raise Malformed("MP4 has no moov box")
    rate, channels = _mp4_audio(data, moov)
    return Container(_mp4_duration(data, moov), rate, channels)


def read_mp4_aac(data: bytes) -> Decoded | None:
    """What FFmpeg decodes of the first sound track when it is AAC: every frame whole, 1024
    samples each (the last frame's padding is kept, whatever its stts delta says), less the
    samples the edit list skips at the start (its first `media_time`: the priming, when the
    muxer wrote it so; FFmpeg writes 0 unless the frames carry timestamps). mvhd states the
    edited length, so it is shorter by the padding. None when there is no AAC sound track
    with a sample table (fragmented files)."""
    moov = _mp4_child(data, 0, len(data), b"moov")
    trak = None if moov is None else next(_sound_traks(data, moov), None)
    if trak is None:
        return None
    mdhd = mp4_path(data, *trak, b"mdia", b"mdhd")
    stbl = mp4_path(data, *trak, b"mdia", b"minf", b"stbl")
    stsd = stsz = None
    if stbl is not None:
        stsd, stsz = _mp4_child(data, *stbl, b"stsd"), _mp4_child(data, *stbl, b"stsz")
    if mdhd is None or stsd is None or stsz is None:
        return None
    entry = stsd[0] + 8  # the first sample entry's box: size, type, then its body
    if data[entry + 4 : entry + 8] != b"mp4a":
        return None
    scale = uint(data, mdhd[0] + (20 if uint(data, mdhd[0], 1) == 1 else 12), 4)
    rate = uint(data, entry + 8 + 24, 4) >> 16 or scale  # AudioSampleEntry's 16.16 rate
    frames = uint(data, stsz[0] + 8, 4)
    if not (scale and rate and frames):
        return None
    return Decoded(max(0.0, frames * 1024 / rate - _edit_skip(data, *trak) / scale), rate)


def _edit_skip(data: bytes, trak: int, end: int) -> int:
    """The first edit's media time (mdhd ticks) in the track's edit list; 0 when none."""
    elst = mp4_path(data, trak, end, b"edts", b"elst")
    if elst is None:
        return 0
    width = 8 if uint(data, elst[0], 1) == 1 else 4  # version 1: 64-bit times
    step = 2 * width + 4  # segment duration, media time (signed), rate
    count = min(uint(data, elst[0] + 4, 4), 16)
    for at in range(elst[0] + 8, elst[0] + 8 + step * count, step):
        if at + step > elst[1]:
            break  # a cut-off entry
        media_time = int.from_bytes(data[at + width : at + 2 * width], "big", signed=True)
        if media_time >= 0:  # -1: an empty edit (a delay), not a skip
            return media_time
    return 0
