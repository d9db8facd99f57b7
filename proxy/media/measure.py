"""The gateway's own length of an audio file: what the bytes carry, not what a header claims.

`probe` (audio.py) reads what a file states: a FLAC STREAMINFO, an MP3 Xing header, an Ogg
granule. A client writes those and may lie: one frame claimed and 20,000 carried, "length
unknown" on a 20 MB FLAC. `measure` counts what is there instead, and adds a floor:

* MP3: every frame present (a lost sync is searched for again, as decoders do), less the
  Xing/Info frame and the LAME tag's encoder delay and padding;
* FLAC: every frame header present (sync code, valid fields, CRC-8), its block size summed;
* WAV: the data chunk's bytes / the frame size (a size past the end of the bytes: to the end);
* Ogg: the highest granule of any page of the stream, or the Opus packets counted;
* MP4 and WebM: the sample tables and blocks where they are read (AAC, Opus), else the stated
  duration.

The floor is the bytes / the highest bitrate the codec plausibly has (`MAX_BITRATES`), so no
header can make long audio short. The length is the larger of the count and the floor.
Counting stops once `at_most_s` is passed (the caller refuses such audio anyway). Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.media.audio import (
    _MP3_BITRATES,
    _NEGATIVE_GRANULE,
    AudioFormat,
    AudioInfo,
    NotAudio,
    _Frame,
    _mp3_frame,
    _mp3_start,
    _ogg_opus,
    _ogg_page,
    _skip_id3,
    _streaminfo,
    decoded_length,
    probe,
)
from proxy.media.containers import Malformed, uint
from proxy.media.wav import BadAudio, read_wav

# Bits per second no honest file of the codec exceeds; MP3's is its first frame's table's top.
PCM_CEILING = 96_000 * 24 * 2  # 4.6 Mbps: 96 kHz 24-bit stereo (FLAC, and any other codec)
MAX_BITRATES: dict[str, int] = {"ogg": 512_000, "m4a": 1_600_000, "webm": 1_600_000}
OGG_PER_CHANNEL = 512_000  # Opus tops out at 510 kbps, Vorbis near 500 kbps a channel
MAX_STEPS = 500_000  # frames and candidates looked at; past it the rest is extrapolated
MAX_RESYNC = 200_000  # MP3 sync candidates tried after junk
MAX_METADATA_BLOCKS = 1024


@dataclass(frozen=True, slots=True)
class Measured:
    format: AudioFormat
    seconds: float  # the length that counts: max(counted, floor)
    counted_s: float | None  # what the frames or samples present add up to
    floor_s: float  # bytes / the codec's highest plausible bitrate
    claimed_s: float | None  # what the headers state (probe), for the log and the refusal


def measure(data: bytes, at_most_s: float = float("inf")) -> Measured:
    """The audio's length by what it carries; `NotAudio` if it is not audio."""
    info = probe(data)
    kind = info.format
    counted: float | None
    try:
        if kind == "mp3":
            counted, floor = _mp3(data, at_most_s)
        elif kind == "flac":
            counted, floor = _flac(data, at_most_s)
        elif kind == "wav":
            counted, floor = read_wav(data).duration_s, 0.0
        elif kind == "ogg":
            counted, floor = _ogg(data, info)
        else:
            decoded = decoded_length(data)
            counted = max(x for x in (info.duration_s, decoded.seconds if decoded else None, 0.0)
                          if x is not None)
            floor = len(data) * 8 / MAX_BITRATES[kind]
    except (Malformed, BadAudio) as exc:
        raise NotAudio(f"broken {kind} file: {exc}") from None
    return Measured(kind, max(counted or 0.0, floor), counted, floor, info.duration_s)


# --- MP3 ------------------------------------------------------------------------------------


def _info_frame(data: bytes, pos: int, frame: _Frame) -> int | None:
    """Encoder delay + padding if the frame at `pos` is a Xing/Info/VBRI frame (no audio of
    its own; decoders skip it), else None."""
    side = (32 if not frame.mono else 17) if frame.version == 3 else (17 if not frame.mono else 9)
    xing = pos + 4 + side
    if data[xing : xing + 4] in (b"Xing", b"Info"):
        flags = uint(data, xing + 4, 4)
        lame = xing + 8 + sum(n for bit, n in ((1, 4), (2, 4), (4, 100), (8, 4)) if flags & bit)
        if data[lame : lame + 4].isalpha() and lame + 24 <= len(data):
            skip = int.from_bytes(data[lame + 21 : lame + 24], "big")
            return (skip >> 12) + (skip & 0xFFF)
        return 0
    return 0 if data[pos + 36 : pos + 40] == b"VBRI" else None


def _mp3(data: bytes, at_most_s: float) -> tuple[float, float]:
    start = _mp3_start(data)
    first = _mp3_frame(data, start) if start is not None else None
    if start is None or first is None:
        raise NotAudio("no MPEG audio frame found")
    top = _MP3_BITRATES[first.version == 3, first.layer][-1] * 1000
    floor = (len(data) - start) * 8 / top
    trim = _info_frame(data, start, first)
    pos, samples, steps, resyncs, gave_up = start, 0, 0, 0, False
    if trim is not None:
        pos += first.length
    limit = at_most_s * first.rate
    while pos < len(data) and samples <= limit:
        steps += 1
        if steps > MAX_STEPS:
            gave_up = True
            break
        frame = _mp3_frame(data, pos)
        if frame and frame.same_stream(first) and pos + frame.length <= len(data):
            samples += frame.samples
            pos += frame.length
            continue
        # Junk, or a cut: look for the next frame of the stream that another one follows.
        while resyncs < MAX_RESYNC:
            resyncs += 1
            pos = data.find(b"\xff", pos + 1)
            if pos < 0:
                break
            frame = _mp3_frame(data, pos)
            if frame and frame.same_stream(first) and pos + frame.length <= len(data):
                after = _mp3_frame(data, pos + frame.length)
                if pos + frame.length == len(data) or (after and after.same_stream(first)):
                    break
        else:
            gave_up = True
            break
        if pos < 0:
            break
    seconds = max(0, samples - (trim or 0)) / first.rate
    if gave_up and start < pos < len(data):  # too much to look at: extrapolate
        seconds *= (len(data) - start) / (pos - start)
    return seconds, floor


# --- FLAC -----------------------------------------------------------------------------------

_FLAC_SYNC = re.compile(rb"\xff[\xf8\xf9]")
_UTF8_LEADS = (0x80, 0xE0, 0xF0, 0xF8, 0xFC, 0xFE, 0xFF)  # below each: 0, 1, ... 6 more bytes
_FLAC_RATES = (0, 88200, 176400, 192000, 8000, 16000, 22050, 24000, 32000, 44100, 48000, 96000)


def _crc8_of(byte: int) -> int:
    for _ in range(8):
        byte = ((byte << 1) ^ 0x07) & 0xFF if byte & 0x80 else (byte << 1) & 0xFF
    return byte


_CRC8 = [_crc8_of(i) for i in range(256)]  # FLAC's header CRC: polynomial x^8 + x^2 + x + 1


def _crc8(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc = _CRC8[crc ^ byte]
    return crc


def _flac_frame(data: bytes, pos: int, stream_rate: int) -> tuple[int, int] | None:
    """(samples, rate) of the FLAC frame whose header starts at `pos`, or None if the bytes
    there are no valid frame header (reserved values, a bad UTF-8 number, a CRC-8 mismatch)."""
    head = data[pos : pos + 16]
    if len(head) < 6:
        return None
    size_code, rate_code = head[2] >> 4, head[2] & 0x0F
    if size_code == 0 or rate_code == 15 or head[3] >> 4 > 10 or (head[3] >> 1) & 7 == 3 \
            or head[3] & 1:
        return None
    lead, end = head[4], 5  # the frame or sample number, UTF-8 coded (up to 7 bytes)
    extra = next((n for n, top in enumerate(_UTF8_LEADS) if lead < top), -1)
    if extra < 0 or 0x80 <= lead < 0xC0:
        return None
    if any(b & 0xC0 != 0x80 for b in head[end : end + extra]):
        return None
    end += extra
    if size_code == 1:
        samples = 192
    elif size_code <= 5:
        samples = 576 << (size_code - 2)
    elif size_code <= 7:
        width = 1 if size_code == 6 else 2
        samples = int.from_bytes(head[end : end + width], "big") + 1
        end += width
    else:
        samples = 256 << (size_code - 8)
    if rate_code == 0:
        rate = stream_rate
    elif rate_code < 12:
        rate = _FLAC_RATES[rate_code]
    else:
        width = 1 if rate_code == 12 else 2
        value = int.from_bytes(head[end : end + width], "big")
        rate = value * 1000 if rate_code == 12 else value if rate_code == 13 else value * 10
        end += width
    if end >= len(head) or not rate or _crc8(head[:end]) != head[end]:
        return None
    return samples, rate


def _flac(data: bytes, at_most_s: float) -> tuple[float, float]:
    pos = _skip_id3(data) + 4
    rate, channels, _ = _streaminfo(data, pos)
    bits = ((data[pos + 4 + 12] & 1) << 4 | data[pos + 4 + 13] >> 4) + 1
    for _ in range(MAX_METADATA_BLOCKS):  # the metadata blocks, up to the last one
        if pos + 4 > len(data):
            break
        last, size = data[pos] & 0x80, uint(data, pos + 1, 3)
        pos += 4 + size
        if last:
            break
    start = pos
    floor = max(0, len(data) - start) * 8 / min(rate * channels * bits * 1.1, PCM_CEILING)
    samples, other_s, stopped = 0, 0.0, None  # other_s: frames at another rate
    for steps, match in enumerate(_FLAC_SYNC.finditer(data, start), 1):
        if samples / rate + other_s > at_most_s:
            break
        if steps > MAX_STEPS:
            stopped = match.start()
            break
        frame = _flac_frame(data, match.start(), rate)
        if frame is not None and frame[1] == rate:
            samples += frame[0]
        elif frame is not None:
            other_s += frame[0] / frame[1]
    seconds = samples / rate + other_s
    if stopped is not None and stopped > start:  # too many to look at: extrapolate
        seconds *= (len(data) - start) / (stopped - start)
    return seconds, floor


# --- Ogg ------------------------------------------------------------------------------------


def _ogg(data: bytes, info: AudioInfo) -> tuple[float | None, float]:
    """The highest granule of the first stream's pages (a lower one on the last page does not
    shorten the stream), or the Opus packets counted, whichever is more."""
    first = _ogg_page(data, 0)
    floor = len(data) * 8 / (OGG_PER_CHANNEL * max(1, info.channels or 2))
    rate = info.sample_rate
    if not rate:
        return None, len(data) * 8 / MAX_BITRATES["ogg"]
    skip = 0
    body = data[first.body : first.end]
    if body.startswith(b"OpusHead") and len(body) >= 19:
        skip = int.from_bytes(body[10:12], "little")
    elif body.startswith(b"\x7fFLAC"):
        floor = len(data) * 8 / PCM_CEILING
    pos, top, steps = 0, 0, 0
    while pos + 27 <= len(data) and steps < MAX_STEPS:
        steps += 1
        try:
            page = _ogg_page(data, pos)
        except Malformed:
            found = data.find(b"OggS", pos + 1)  # junk between pages: find the next one
            if found < 0:
                break
            pos = found
            continue
        if page.serial == first.serial and page.granule < _NEGATIVE_GRANULE:
            top = max(top, page.granule)
        pos = max(page.end, pos + 1)
    counted = max(0, top - skip) / rate
    opus = _ogg_opus(data)
    if opus is not None:
        counted = max(counted, opus.seconds)
    return counted, floor
