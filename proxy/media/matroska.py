"""Reader for Matroska/WebM (EBML) containers, shared by audio and video: duration, the first
audio track's format, and the length FFmpeg decodes of an Opus track.

The same rules as containers.py: hostile bytes, bounded loops (an element budget), nothing
recursive, every structural fault `Malformed`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

from proxy.media.containers import Container, Decoded, Malformed, opus_samples

MAX_ELEMENTS = 300_000  # EBML elements read per file

EBML, SEGMENT, CLUSTER = 0x1A45DFA3, 0x18538067, 0x1F43B675
_DOCTYPE, _INFO, _SCALE, _DURATION = 0x4282, 0x1549A966, 0x2AD7B1, 0x4489
_TRACKS, _ENTRY, _AUDIO, _FREQ, _CHANNELS = 0x1654AE6B, 0xAE, 0xE1, 0xB5, 0x9F
_NUMBER, _CODEC, _CODEC_DELAY = 0xD7, 0x86, 0x56AA
_TIMECODE, _SIMPLE_BLOCK, _BLOCK_GROUP, _BLOCK, _DISCARD = 0xE7, 0xA3, 0xA0, 0xA1, 0x75A2
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
        offset = _block_header(data, *span)[1]
        if offset is not None:
            latest = offset if latest is None else max(latest, offset)
    return None if latest is None else base + latest


def _block_header(data: bytes, start: int, end: int) -> tuple[int, int | None, int, int]:
    """(track number, time offset or None when cut off, flags, where the frame starts) of a
    Block or SimpleBlock: a track number (a vint), a signed 16-bit offset, a flags byte."""
    raw, width = _vint(data, start, end, 8)
    at = start + width
    offset = int.from_bytes(data[at : at + 2], "big", signed=True) if at + 2 <= end else None
    flags = data[at + 2] if at + 2 < end else 0
    return raw & ((1 << 7 * width) - 1), offset, flags, at + 3


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


def _segment(data: bytes, budget: _Budget) -> tuple[int, int]:
    for eid, body, end in ebml_elements(data, 0, len(data), budget):
        if eid == SEGMENT:
            return body, end
    raise Malformed("Matroska file has no Segment")


def read_ebml(data: bytes) -> Container:
    """Duration (Segment/Info/Duration x TimecodeScale) and the first audio track of a
    Matroska/WebM file; without a Duration (browser MediaRecorder output) the last block's
    timestamp stands in."""
    budget = _Budget()
    segment = _segment(data, budget)
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


def _opus_track(data: bytes, body: int, end: int, budget: _Budget) -> tuple[int, int] | None:
    """(track number, CodecDelay in ns) of the first A_OPUS entry of a Tracks element."""
    for eid, tbody, tend in ebml_elements(data, body, end, budget):
        if eid != _ENTRY:
            continue
        fields = {fid: data[fbody:fend]
                  for fid, fbody, fend in ebml_elements(data, tbody, tend, budget)}
        if fields.get(_CODEC, b"").rstrip(b"\x00") == b"A_OPUS":
            number = int.from_bytes(fields.get(_NUMBER, b""), "big")
            return number, int.from_bytes(fields.get(_CODEC_DELAY, b""), "big")
    return None


def read_ebml_opus(data: bytes) -> Decoded | None:
    """What FFmpeg decodes of the first Opus track of a Matroska/WebM file: every block's
    samples, less the CodecDelay (the pre-skip) and the DiscardPadding of its blocks (the
    end trim). The Duration counts the last block whole, so it overstates by the padding
    (3 s: 3.008). Browser MediaRecorder files, with no Duration at all, are read the same
    way. None when there is no Opus track, its blocks are laced (several frames a block,
    not counted here), or the element budget runs out."""
    budget = _Budget()
    track, total, discard = None, 0, 0
    for eid, body, end in ebml_elements(data, *_segment(data, budget), budget):
        if eid == _TRACKS and track is None:
            track = _opus_track(data, body, end, budget)
        if eid != CLUSTER or track is None:
            continue
        for bid, bbody, bend in ebml_elements(data, body, end, budget):
            padding = 0
            if bid == _BLOCK_GROUP:
                parts = {i: (b, e) for i, b, e in ebml_elements(data, bbody, bend, budget)}
                bbody, bend = parts.get(_BLOCK, (0, 0))
                if _DISCARD in parts:
                    at, stop = parts[_DISCARD]
                    padding = int.from_bytes(data[at:stop], "big", signed=True)
            elif bid != _SIMPLE_BLOCK:
                continue
            if bend <= bbody:
                continue
            try:
                number, _, flags, frame = _block_header(data, bbody, bend)
            except Malformed:
                continue  # an unreadable track number: that block only is lost
            if number != track[0]:
                continue
            if flags & 0x06:
                return None
            total += opus_samples(data[frame : min(frame + 2, bend)])
            discard += padding
    if track is None or budget.left < 0:
        return None
    skip = track[1] * 48000 // 1_000_000_000
    return Decoded(max(0, total - skip - discard * 48000 // 1_000_000_000) / 48000, 48000)
