"""Readers for RIFF, ISO-BMFF (MP4/M4A) and Matroska/WebM containers, shared by audio and video.

They read hostile bytes: loops are bounded by counts or by forward progress, nothing recurses,
and every structural fault is `Malformed` (never IndexError or struct.error); the callers turn
it into their own NotAudio / NotMedia.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

MAX_CHUNKS = 10_000  # RIFF chunks per list
MAX_BOXES = 10_000  # MP4 boxes per level
MAX_ELEMENTS = 300_000  # EBML elements read per file


class Malformed(ValueError):
    """A container's structure is broken; the message is safe to show a client."""


@dataclass(frozen=True, slots=True)
class Container:
    """What an MP4 or Matroska/WebM reader learned; None where the file does not say."""

    duration_s: float | None
    sample_rate: int | None
    channels: int | None


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


def _mp4_audio(data: bytes, moov: tuple[int, int]) -> tuple[int | None, int | None]:
    """(sample rate, channels) of the first sound track's first sample entry."""
    for kind, body, end in mp4_boxes(data, *moov):
        if kind != b"trak":
            continue
        hdlr = mp4_path(data, body, end, b"mdia", b"hdlr")
        if hdlr is None or data[hdlr[0] + 8 : hdlr[0] + 12] != b"soun":
            continue
        stsd = mp4_path(data, body, end, b"mdia", b"minf", b"stbl", b"stsd")
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


# --- Matroska / WebM ----------------------------------------------------------------------

EBML, SEGMENT, CLUSTER = 0x1A45DFA3, 0x18538067, 0x1F43B675
_DOCTYPE, _INFO, _SCALE, _DURATION = 0x4282, 0x1549A966, 0x2AD7B1, 0x4489
_TRACKS, _ENTRY, _AUDIO, _FREQ, _CHANNELS = 0x1654AE6B, 0xAE, 0xE1, 0xB5, 0x9F
_TIMECODE, _SIMPLE_BLOCK, _BLOCK_GROUP, _BLOCK = 0xE7, 0xA3, 0xA0, 0xA1
_TOP = frozenset({EBML, SEGMENT})
# Where an unknown-size element ends: at the next element with one of these ids.
_ENDS = {SEGMENT: _TOP, CLUSTER: _TOP | {0x114D9B74, _INFO, _TRACKS, CLUSTER, 0x1C53BB6B,
                                         0x1941A469, 0x1043A770, 0x1254C367}}


class _Budget:
    """Elements left to read: hostile files cannot make a walk slow."""

    def __init__(self) -> None:
        self.left = MAX_ELEMENTS

    def spend(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _vint(data: bytes, pos: int, end: int, max_len: int) -> tuple[int, int]:
    """(raw value, byte length) of the EBML variable-length int at `pos`, marker included."""
    if pos >= end:
        raise Malformed("truncated EBML")
    length = 9 - data[pos].bit_length()
    if length > max_len:
        raise Malformed("bad EBML length marker")
    if pos + length > end:
        raise Malformed("truncated EBML")
    return int.from_bytes(data[pos : pos + length], "big"), length


def _ebml_header(data: bytes, pos: int, end: int) -> tuple[int, int, int | None]:
    """(id, body start, size or None when unknown) of the element at `pos`."""
    eid, id_len = _vint(data, pos, end, 4)
    raw, size_len = _vint(data, pos + id_len, end, 8)
    mask = (1 << (7 * size_len)) - 1
    size = raw & mask
    return eid, pos + id_len + size_len, None if size == mask else size


def ebml_elements(data: bytes, start: int, end: int,
                  budget: _Budget | None = None) -> Iterator[tuple[int, int, int]]:
    """(id, body start, body end) of each element in [start, end); cut-off ones are clamped.

    An unknown-size element (live streams write them) ends at the next element that can only
    be its sibling or an ancestor's (see `_ENDS`), or else at `end`.
    """
    budget = budget or _Budget()
    pos = start
    while pos < end and budget.spend():
        eid, body, size = _ebml_header(data, pos, end)
        if size is not None:
            body_end = min(body + size, end)
        else:
            stops, body_end, child = _ENDS.get(eid, frozenset()), end, body
            while child < end and budget.spend():
                cid, cbody, csize = _ebml_header(data, child, end)
                if cid in stops or csize is None:
                    body_end = child if cid in stops else end
                    break
                child = cbody + csize
        yield eid, body, body_end
        pos = body_end


def _ebml_uint(data: bytes, body: int, end: int) -> int:
    if end - body > 8:
        raise Malformed("EBML integer too long")
    return int.from_bytes(data[body:end], "big")


def _ebml_float(data: bytes, body: int, end: int) -> float | None:
    if end - body not in (0, 4, 8):
        raise Malformed("EBML float has a bad size")
    if end == body:
        return 0.0
    (value,) = struct.unpack(">f" if end - body == 4 else ">d", data[body:end])
    return float(value) if math.isfinite(value) and value >= 0 else None


def ebml_doctype(data: bytes) -> str:
    """The DocType of the EBML header at offset 0 ("webm", "matroska", ...)."""
    for eid, body, end in ebml_elements(data, 0, len(data)):
        if eid != EBML:
            raise Malformed("no EBML header")
        for cid, cbody, cend in ebml_elements(data, body, end):
            if cid == _DOCTYPE:
                return data[cbody:cend].rstrip(b"\x00").decode("ascii", "replace")
        return "matroska"  # the spec's default
    raise Malformed("no EBML header")


def _last_block_time(data: bytes, body: int, end: int, budget: _Budget) -> int | None:
    """Cluster timecode plus the largest block offset in it, in TimecodeScale units."""
    base, latest = 0, None
    for eid, cbody, cend in ebml_elements(data, body, end, budget):
        if eid == _TIMECODE:
            base = _ebml_uint(data, cbody, cend)
            continue
        if eid == _BLOCK_GROUP:
            blocks = ebml_elements(data, cbody, cend, budget)
            span = next(((b, e) for i, b, e in blocks if i == _BLOCK), None)
        else:
            span = (cbody, cend) if eid == _SIMPLE_BLOCK else None
        if span is None or span[1] <= span[0]:
            continue
        # A block starts with its track number (a vint), then a signed 16-bit offset.
        _, track_len = _vint(data, span[0], span[1], 8)
        at = span[0] + track_len
        if at + 2 <= span[1]:
            offset = int.from_bytes(data[at : at + 2], "big", signed=True)
            latest = offset if latest is None else max(latest, offset)
    return None if latest is None else base + latest


def _tracks_audio(data: bytes, body: int, end: int,
                  budget: _Budget) -> tuple[int | None, int | None]:
    for eid, tbody, tend in ebml_elements(data, body, end, budget):
        if eid != _ENTRY:
            continue
        for aid, abody, aend in ebml_elements(data, tbody, tend, budget):
            if aid != _AUDIO:
                continue
            rate, channels = 8000.0, 1  # Matroska's defaults
            for fid, fbody, fend in ebml_elements(data, abody, aend, budget):
                if fid == _FREQ:
                    rate = _ebml_float(data, fbody, fend) or 0.0
                elif fid == _CHANNELS:
                    channels = _ebml_uint(data, fbody, fend)
            return round(rate) or None, channels or None
    return None, None


def read_ebml(data: bytes) -> Container:
    """Duration (Segment/Info/Duration x TimecodeScale) and the first audio track of a
    Matroska/WebM file; without a Duration (browser MediaRecorder output) the last block's
    timestamp stands in."""
    budget = _Budget()
    segment = next(((b, e) for i, b, e in ebml_elements(data, 0, len(data), budget)
                    if i == SEGMENT), None)
    if segment is None:
        raise Malformed("Matroska file has no Segment")
    scale, duration, last = 1_000_000, None, None
    rate: int | None = None
    channels: int | None = None
    for eid, body, end in ebml_elements(data, *segment, budget):
        if eid == _INFO:
            for cid, cbody, cend in ebml_elements(data, body, end, budget):
                if cid == _SCALE:
                    scale = _ebml_uint(data, cbody, cend) or scale
                elif cid == _DURATION:
                    duration = _ebml_float(data, cbody, cend)
        elif eid == _TRACKS and rate is None:
            rate, channels = _tracks_audio(data, body, end, budget)
        elif eid == CLUSTER and duration is None:
            block = _last_block_time(data, body, end, budget)
            if block is not None:
                last = max(last if last is not None else block, block)
    ticks = duration if duration is not None else last
    return Container(None if ticks is None else max(0.0, ticks * scale / 1e9), rate, channels)
