"""Identify audio by its bytes and measure its duration, for ASR metering and upload checks.

Formats are told by magic bytes only: a file part's name and Content-Type are client claims.
Every reader here works on hostile bytes: loops are bounded by counts or by forward progress,
nothing recurses, and any structural fault surfaces as `NotAudio`, never as IndexError or
struct.error. The MP4 and Matroska readers live in containers.py and matroska.py, shared with
video. `decoded_length` tells where FFmpeg's decoders put out another length than the
container states (Opus's pre-skip and end trimming, AAC's whole frames).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.media.containers import (
    Decoded,
    Malformed,
    opus_samples,
    read_mp4,
    read_mp4_aac,
    uint,
)
from proxy.media.matroska import ebml_doctype, read_ebml, read_ebml_opus
from proxy.media.wav import BadAudio, read_wav

AudioFormat = Literal["wav", "mp3", "m4a", "webm", "flac", "ogg"]
FORMATS: tuple[AudioFormat, ...] = ("wav", "mp3", "m4a", "webm", "flac", "ogg")

MAX_MP3_FRAMES = 100_000  # ~43 min of 44.1 kHz MPEG-1; longer files are extrapolated
MAX_ID3_TAGS = 8
MAX_ID3_PADDING = 64 * 1024
MAX_OGG_BACKTRACK = 64


class NotAudio(ValueError):
    """Not a recognised audio file, or its container is broken; safe to show a client."""


@dataclass(frozen=True, slots=True)
class AudioInfo:
    format: AudioFormat
    duration_s: float | None
    sample_rate: int | None
    channels: int | None


# --- MP3 ---------------------------------------------------------------------------------

_MP3_BITRATES = {  # kbps by (MPEG-1?, layer), index 1..14
    (True, 1): (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 3): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


@dataclass(frozen=True, slots=True)
class _Frame:
    version: int  # header bits: 3 = MPEG-1, 2 = MPEG-2, 0 = MPEG-2.5
    layer: int
    rate: int
    mono: bool
    length: int
    samples: int

    def same_stream(self, other: _Frame) -> bool:
        return (self.version, self.layer, self.rate) == (other.version, other.layer, other.rate)


def _mp3_frame(data: bytes, pos: int) -> _Frame | None:
    """The MPEG audio frame header at `pos`, or None if these 4 bytes are not one."""
    if pos < 0 or pos + 4 > len(data):
        return None
    b0, b1, b2, b3 = data[pos : pos + 4]
    version, layer_bits = (b1 >> 3) & 3, (b1 >> 1) & 3
    bitrate_index, rate_index = b2 >> 4, (b2 >> 2) & 3
    if b0 != 0xFF or b1 & 0xE0 != 0xE0 or version == 1 or layer_bits == 0:
        return None
    # Free-format (0) and bad (15) bitrates, reserved rate and emphasis values are rejected.
    if bitrate_index in (0, 15) or rate_index == 3 or b3 & 3 == 2:
        return None
    layer = 4 - layer_bits
    mpeg1 = version == 3
    bitrate = _MP3_BITRATES[mpeg1, layer][bitrate_index - 1] * 1000
    rate = _MP3_RATES[version][rate_index]
    padding = (b2 >> 1) & 1
    if layer == 1:
        length, samples = (12 * bitrate // rate + padding) * 4, 384
    elif layer == 2 or mpeg1:
        length, samples = 144 * bitrate // rate + padding, 1152
    else:
        length, samples = 72 * bitrate // rate + padding, 576
    return _Frame(version, layer, rate, b3 >> 6 == 3, length, samples)


def _skip_id3(data: bytes) -> int:
    """Offset just past any leading ID3v2 tags (several are sometimes stacked)."""
    pos = 0
    for _ in range(MAX_ID3_TAGS):
        head = data[pos : pos + 10]
        if len(head) < 10 or head[:3] != b"ID3" or head[3] not in (2, 3, 4):
            break
        if any(b & 0x80 for b in head[6:10]):  # the size is syncsafe: 7 bits a byte
            break
        size = (head[6] << 21) | (head[7] << 14) | (head[8] << 7) | head[9]
        pos += 10 + size + (10 if head[5] & 0x10 else 0)  # 0x10: a footer follows
    return pos


def _skip_zeros(data: bytes, pos: int) -> int:
    # Some taggers pad past the declared ID3 size with zeros before the first frame.
    window = data[pos : pos + MAX_ID3_PADDING]
    return pos + len(window) - len(window.lstrip(b"\0"))


def _mp3_start(data: bytes) -> int | None:
    """Where the first MPEG audio frame starts, if this really is MP3."""
    tagged = _skip_id3(data)
    if tagged:
        pos = _skip_zeros(data, tagged)
        return pos if _mp3_frame(data, pos) else None
    first = _mp3_frame(data, 0)
    # Two consecutive headers make a false positive on text or noise very unlikely.
    second = _mp3_frame(data, first.length) if first else None
    return 0 if first and second and first.same_stream(second) else None


def _vbr_samples(data: bytes, pos: int, frame: _Frame) -> int | None:
    """Audio samples declared by a Xing/Info or VBRI header in the first frame, less the
    encoder delay and padding a LAME tag after Xing records (as ffprobe reports)."""
    side = (32 if not frame.mono else 17) if frame.version == 3 else (17 if not frame.mono else 9)
    xing = pos + 4 + side
    if data[xing : xing + 4] in (b"Xing", b"Info"):
        flags = uint(data, xing + 4, 4)
        if not flags & 1:
            return None
        samples = uint(data, xing + 8, 4) * frame.samples
        # Optional fields: frames (4), bytes (4), TOC (100), quality (4); then the LAME tag.
        lame = xing + 8 + sum(n for bit, n in ((1, 4), (2, 4), (4, 100), (8, 4)) if flags & bit)
        if data[lame : lame + 4].isalpha() and lame + 24 <= len(data):
            skip = int.from_bytes(data[lame + 21 : lame + 24], "big")
            samples = max(0, samples - (skip >> 12) - (skip & 0xFFF))
        return samples
    vbri = pos + 36
    if data[vbri : vbri + 4] == b"VBRI":
        return uint(data, vbri + 14, 4) * frame.samples
    return None


def _probe_mp3(data: bytes) -> AudioInfo:
    start = _mp3_start(data)
    first = _mp3_frame(data, start) if start is not None else None
    if start is None or first is None:
        raise NotAudio("no MPEG audio frame found")
    channels = 1 if first.mono else 2
    counted = _vbr_samples(data, start, first)
    if counted is not None:
        return AudioInfo("mp3", counted / first.rate, first.rate, channels)
    pos, frames, samples = start, 0, 0
    while frames < MAX_MP3_FRAMES:
        frame = _mp3_frame(data, pos)
        if frame is None or not frame.same_stream(first) or pos + frame.length > len(data):
            break  # a trailing tag (ID3v1, APE), junk, or a cut-off last frame
        samples += frame.samples
        frames += 1
        pos += frame.length
    if frames == 0:
        raise NotAudio("MP3 has no complete frame")
    seconds = samples / first.rate
    if frames == MAX_MP3_FRAMES and pos < len(data):
        seconds *= (len(data) - start) / (pos - start)
    return AudioInfo("mp3", seconds, first.rate, channels)


# --- FLAC ---------------------------------------------------------------------------------


def _streaminfo(data: bytes, pos: int) -> tuple[int, int, int]:
    """(sample rate, channels, total samples) from the STREAMINFO block header at `pos`."""
    if uint(data, pos, 1) & 0x7F != 0 or uint(data, pos + 1, 3) < 34:
        raise Malformed("FLAC does not start with STREAMINFO")
    si = data[pos + 4 : pos + 4 + 34]
    if len(si) < 34:
        raise Malformed("FLAC STREAMINFO is truncated")
    rate = (si[10] << 12) | (si[11] << 4) | (si[12] >> 4)
    channels = ((si[12] >> 1) & 7) + 1
    total = ((si[13] & 0x0F) << 32) | int.from_bytes(si[14:18], "big")
    if rate == 0:
        raise Malformed("FLAC sample rate is 0")
    return rate, channels, total


def _probe_flac(data: bytes) -> AudioInfo:
    pos = _skip_id3(data)
    rate, channels, total = _streaminfo(data, pos + 4)
    return AudioInfo("flac", total / rate if total else None, rate, channels)


# --- Ogg ----------------------------------------------------------------------------------

_NO_GRANULE = 0xFFFFFFFFFFFFFFFF  # no packet ends on this page
_NEGATIVE_GRANULE = 1 << 63  # granules are signed: from here on, no timestamp


@dataclass(frozen=True, slots=True)
class _Page:
    flags: int  # 1: continues a packet, 2: first page, 4: last page
    granule: int  # as written, unsigned
    serial: int
    lacing: bytes  # the segment sizes: a packet ends at the first one below 255
    body: int  # where the first segment starts

    @property
    def end(self) -> int:
        return self.body + sum(self.lacing)


def _ogg_page(data: bytes, pos: int) -> _Page:
    if data[pos : pos + 4] != b"OggS" or uint(data, pos + 4, 1) != 0:
        raise Malformed("bad Ogg page")
    count = uint(data, pos + 26, 1)
    lacing = data[pos + 27 : pos + 27 + count]
    if len(lacing) < count:
        raise Malformed("Ogg page is truncated")
    return _Page(data[pos + 5], uint(data, pos + 6, 8, "little"),
                 uint(data, pos + 14, 4, "little"), lacing, pos + 27 + count)


def _probe_ogg(data: bytes) -> AudioInfo:
    first = _ogg_page(data, 0)
    length = 0
    for value in first.lacing:
        length += value
        if value < 255:
            break
    head = data[first.body : first.body + length]
    rate: int | None
    skip = 0
    if head.startswith(b"OpusHead") and len(head) >= 19:
        rate, channels = 48000, head[9]  # Opus granules always count 48 kHz samples
        skip = int.from_bytes(head[10:12], "little")
    elif head.startswith(b"\x01vorbis") and len(head) >= 16:
        channels, rate = head[11], int.from_bytes(head[12:16], "little")
    elif head.startswith(b"\x7fFLAC") and head[9:13] == b"fLaC":
        rate, channels, _ = _streaminfo(head, 13)
    else:
        return AudioInfo("ogg", None, None, None)  # a codec we do not measure
    if not rate or not channels:
        raise NotAudio("Ogg stream header has a zero rate or channel count")
    end = len(data)
    for _ in range(MAX_OGG_BACKTRACK):
        pos = data.rfind(b"OggS", 0, end)
        if pos < 0:
            break
        end = pos + 3
        try:
            page = _ogg_page(data, pos)
        except Malformed:
            continue  # "OggS" inside a packet, or a cut-off last page
        if page.serial == first.serial and page.granule != _NO_GRANULE:
            return AudioInfo("ogg", max(0, page.granule - skip) / rate, rate, channels)
    return AudioInfo("ogg", None, rate, channels)


def _ogg_opus(data: bytes) -> Decoded | None:
    """What FFmpeg decodes from Ogg Opus: every audio packet's samples, less the OpusHead
    pre-skip and the end trimming the last (end-of-stream) page's granule implies (the
    running timestamp, started where the first granule says, past that granule). FFmpeg's
    muxer starts its granules a pre-skip in (3 s: the first 48,000 samples end at granule
    48,312, the last page at 144,624), so the last granule less pre-skip overstates the
    audio by a pre-skip; the decoder gets the 144,000 samples encoded. None when this is not
    Ogg Opus."""
    pos, serial, index, packet = 0, None, 0, bytearray()
    total = skip = trim = 0  # 48 kHz samples of the audio packets so far; pre-skip; trimmed
    start: int | None = None  # the running timestamp's origin, from the first granule
    while pos + 27 <= len(data):
        try:
            page = _ogg_page(data, pos)
        except Malformed:
            break  # a cut-off page: the decoder stops at what it has
        body, pos = page.body, page.end
        if pos > len(data):
            break
        serial = page.serial if serial is None else serial
        if page.serial != serial:
            continue
        if not page.flags & 1:
            packet.clear()  # not a continuation: whatever was pending is lost
        for value in page.lacing:
            packet += data[body : body + value]
            body += value
            if value == 255:
                continue
            if index == 0:
                if not packet.startswith(b"OpusHead") or len(packet) < 19:
                    return None
                skip = int.from_bytes(packet[10:12], "little")
            elif index > 1:  # index 1: OpusTags
                total += opus_samples(bytes(packet[:2]))
            index += 1
            packet.clear()
        if page.granule < _NEGATIVE_GRANULE and index > 2:
            if start is None:
                start = page.granule - total
            if page.flags & 4:  # end of stream: FFmpeg trims what runs past the granule
                trim = max(0, start + total - page.granule)
    if index == 0:
        return None
    return Decoded(max(0, total - skip - trim) / 48000, 48000)


# --- identification -----------------------------------------------------------------------


def sniff(data: bytes) -> AudioFormat | None:
    """The audio format these bytes are, by magic bytes alone."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        try:
            return "webm" if ebml_doctype(data) in ("webm", "matroska") else None
        except Malformed:
            return None
    if data[4:8] == b"ftyp" and int.from_bytes(data[:4], "big") >= 8:
        return "m4a"
    if data[_skip_id3(data) :][:4] == b"fLaC":
        return "flac"
    return "mp3" if _mp3_start(data) is not None else None


def probe(data: bytes) -> AudioInfo:
    """Format, duration, rate and channels; `NotAudio` if unrecognised or broken."""
    kind = sniff(data)
    try:
        if kind == "wav":
            pcm = read_wav(data)
            return AudioInfo("wav", pcm.duration_s, pcm.rate, pcm.channels)
        if kind == "mp3":
            return _probe_mp3(data)
        if kind == "flac":
            return _probe_flac(data)
        if kind == "ogg":
            return _probe_ogg(data)
        if kind == "m4a":
            info = read_mp4(data)
        elif kind == "webm":
            info = read_ebml(data)
        else:
            raise NotAudio("not a recognised audio file (wav, mp3, m4a, webm, flac, ogg)")
    except (BadAudio, Malformed) as exc:
        raise NotAudio(f"broken {kind} file: {exc}") from None
    return AudioInfo(kind, info.duration_s, info.sample_rate, info.channels)


def decoded_length(data: bytes) -> Decoded | None:
    """What FFmpeg's decoder puts out where that is not the container's duration: Opus in Ogg
    and in WebM (less its pre-skip and end trimming), AAC in MP4 (whole frames, less the
    edit list's skip). None for other formats and codecs, or when the file does not tell;
    `NotAudio` if its container is broken."""
    kind = sniff(data)
    try:
        if kind == "ogg":
            return _ogg_opus(data)
        if kind == "m4a":
            return read_mp4_aac(data)
        if kind == "webm":
            return read_ebml_opus(data)
    except Malformed as exc:
        raise NotAudio(f"broken {kind} file: {exc}") from None
    return None
