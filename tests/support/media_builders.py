"""Small, valid audio files built by hand: just the headers the probes read, plus padding.

Each builder follows its format's spec closely enough that a real decoder would accept the
container (Ogg pages carry real CRCs, MP3 frames have valid headers), so the fixtures test the
parsers against the formats, not against themselves.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

# --- FLAC -----------------------------------------------------------------------------------


def flac(rate: int = 16000, channels: int = 1, bits: int = 16, total: int = 48000,
         id3: bool = False) -> bytes:
    """fLaC + one STREAMINFO metadata block (marked last); no frames are needed to probe."""
    packed = (rate << 44) | ((channels - 1) << 41) | ((bits - 1) << 36) | total
    info = struct.pack(">HH", 4096, 4096) + bytes(6) + packed.to_bytes(8, "big") + bytes(16)
    body = b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info
    return (id3_tag(b"\x00" * 20) if id3 else b"") + body


def id3_tag(payload: bytes) -> bytes:
    size = len(payload)
    syncsafe = bytes([(size >> 21) & 0x7F, (size >> 14) & 0x7F, (size >> 7) & 0x7F, size & 0x7F])
    return b"ID3\x04\x00\x00" + syncsafe + payload


# --- Ogg ------------------------------------------------------------------------------------


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else r << 1
        table.append(r & 0xFFFFFFFF)
    return table


_CRC = _crc_table()


def ogg_page(packet: bytes, *, granule: int, seq: int, flags: int = 0,
             serial: int = 0x1234) -> bytes:
    lacing = [255] * (len(packet) // 255) + [len(packet) % 255]
    header = (b"OggS" + bytes([0, flags]) + struct.pack("<qII", granule, serial, seq)
              + bytes(4) + bytes([len(lacing)]) + bytes(lacing))
    page = bytearray(header + packet)
    crc = 0
    for byte in page:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _CRC[((crc >> 24) ^ byte) & 0xFF]
    page[22:26] = struct.pack("<I", crc)
    return bytes(page)


def ogg_opus(seconds: float = 3.0, pre_skip: int = 312, channels: int = 1) -> bytes:
    head = b"OpusHead" + struct.pack("<BBHIhB", 1, channels, pre_skip, 16000, 0, 0)
    tags = b"OpusTags" + struct.pack("<I", 4) + b"test" + struct.pack("<I", 0)
    last = round(seconds * 48000) + pre_skip
    return (ogg_page(head, granule=0, seq=0, flags=2) + ogg_page(tags, granule=0, seq=1)
            + ogg_page(bytes(300), granule=last // 2, seq=2)
            + ogg_page(bytes(40), granule=last, seq=3, flags=4))


def ogg_vorbis(seconds: float = 2.0, rate: int = 44100, channels: int = 2) -> bytes:
    ident = b"\x01vorbis" + struct.pack("<IBIiiiBB", 0, channels, rate, 0, 128000, 0, 0xB8, 1)
    return (ogg_page(ident, granule=0, seq=0, flags=2)
            + ogg_page(bytes(100), granule=round(seconds * rate), seq=1, flags=4))


# --- MP3 ------------------------------------------------------------------------------------

# MPEG-1 Layer III, no CRC, 128 kbps, 48 kHz: 384-byte frames of 1152 samples (24 ms).
MP3_HEADER = b"\xff\xfb\x94\x00"
MP3_MONO_HEADER = b"\xff\xfb\x94\xc0"


def mp3(frames: int = 125, header: bytes = MP3_HEADER, tag: bool = False) -> bytes:
    frame = header + bytes(384 - 4)
    return (id3_tag(b"TIT2" + bytes(20)) if tag else b"") + frame * frames


def mp3_xing(frames: int, header: bytes = MP3_HEADER,
             lame: tuple[int, int] | None = None) -> bytes:
    """A first frame carrying a Xing header (frames flag set) and optionally a LAME tag with
    (encoder delay, padding), then three audio frames."""
    side = 17 if header[3] >> 6 == 3 else 32
    xing = b"Xing" + struct.pack(">II", 1, frames)
    if lame is not None:
        delay, padding = lame
        xing += b"LAME3.100" + bytes(12) + (delay << 12 | padding).to_bytes(3, "big")
    first = header + bytes(side) + xing
    return first + bytes(384 - len(first)) + (header + bytes(380)) * 3


# --- MP4 ------------------------------------------------------------------------------------


def box(kind: bytes, body: bytes, *, wide: bool = False) -> bytes:
    if wide:
        return struct.pack(">I", 1) + kind + struct.pack(">Q", 16 + len(body)) + body
    return struct.pack(">I", 8 + len(body)) + kind + body


def mvhd(scale: int, duration: int, version: int = 0) -> bytes:
    if version == 1:
        times = struct.pack(">QQIQ", 0, 0, scale, duration)
    else:
        times = struct.pack(">IIII", 0, 0, scale, duration)
    rest = struct.pack(">IH", 0x00010000, 0x0100) + bytes(10) + bytes(36) + bytes(24) + b"\0\0\0\2"
    return box(b"mvhd", bytes([version, 0, 0, 0]) + times + rest)


def sound_trak(rate: int = 44100, channels: int = 2) -> bytes:
    hdlr = box(b"hdlr", bytes(8) + b"soun" + bytes(12) + b"\0")
    entry = box(b"mp4a", bytes(6) + struct.pack(">H", 1) + bytes(8)
                + struct.pack(">HHHHI", channels, 16, 0, 0, rate << 16))
    stsd = box(b"stsd", bytes(4) + struct.pack(">I", 1) + entry)
    minf = box(b"minf", box(b"stbl", stsd))
    return box(b"trak", box(b"mdia", hdlr + minf))


def m4a(scale: int = 44100, duration: int = 3 * 44100, version: int = 0,
        moov_last: bool = False) -> bytes:
    ftyp = box(b"ftyp", b"M4A \0\0\0\0M4A mp42isom")
    moov = box(b"moov", mvhd(scale, duration, version) + sound_trak())
    mdat = box(b"mdat", bytes(64), wide=True)
    if moov_last:  # not "fast start": moov after the media, in a to-end (size 0) box
        return ftyp + mdat + struct.pack(">I", 0) + b"moov" + moov[8:]
    return ftyp + moov + mdat


# --- Matroska / WebM ------------------------------------------------------------------------

UNKNOWN = b"\x01\xff\xff\xff\xff\xff\xff\xff"


def el(eid: int, body: bytes, *, unknown: bool = False) -> bytes:
    """An EBML element; the id keeps its length marker, as the specs write ids."""
    ident = eid.to_bytes((eid.bit_length() + 7) // 8, "big")
    if unknown:
        return ident + UNKNOWN + body
    size = b"\x80" if not body else (0x80 | len(body)).to_bytes(1, "big")
    if len(body) >= 127:
        size = b"\x01" + len(body).to_bytes(7, "big")
    return ident + size + body


def ebml_header(doctype: bytes = b"webm") -> bytes:
    return el(0x1A45DFA3, el(0x4286, b"\1") + el(0x42F7, b"\1") + el(0x42F2, b"\4")
              + el(0x42F3, b"\x08") + el(0x4282, doctype) + el(0x4287, b"\4") + el(0x4285, b"\2"))


def webm(duration_ms: float | None = 3000.0, *, doctype: bytes = b"webm",
         unknown_sizes: bool = False,
         blocks: Sequence[tuple[int, int]] = ((0, 0), (1000, 500), (2000, 980)),
         scale: int = 1_000_000) -> bytes:
    """EBML header + Segment(Info, Tracks, Clusters); `blocks` are (cluster ms, block offset)."""
    info = el(0x2AD7B1, scale.to_bytes(3, "big"))
    if duration_ms is not None:
        info += el(0x4489, struct.pack(">d", duration_ms))
    audio = el(0xE1, el(0xB5, struct.pack(">f", 48000.0)) + el(0x9F, b"\x01"))
    track = el(0xAE, el(0xD7, b"\1") + el(0x83, b"\2") + el(0x86, b"A_OPUS") + audio)
    clusters = b""
    for cluster_time, offset in blocks:
        block = el(0xA3, b"\x81" + struct.pack(">hB", offset, 0x80) + bytes(20))
        clusters += el(0x1F43B675, el(0xE7, cluster_time.to_bytes(2, "big")) + block,
                       unknown=unknown_sizes)
    segment = el(0x1549A966, info) + el(0x1654AE6B, track) + clusters
    return ebml_header(doctype) + el(0x18538067, segment, unknown=unknown_sizes)


# --- images ---------------------------------------------------------------------------------


def gif(width: int = 1, height: int = 1, delays: Sequence[int] = (10, 25)) -> bytes:
    """GIF89a with a 2-colour global table and one 1-pixel-LZW frame per delay (centiseconds);
    an empty `delays` makes a still image without Graphic Control Extensions."""
    out = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00"
    for delay in delays or (None,):
        if delay is not None:
            out += b"\x21\xf9\x04\x00" + struct.pack("<H", delay) + b"\x00\x00"
        out += frame
    return out + b"\x21\xfe\x03abc\x00" + b"\x3b"  # a comment extension, then the trailer


def jpeg(width: int, height: int) -> bytes:
    """SOI, a JFIF APP0, a fill byte, a standalone RST marker, SOF0 and EOI."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0\1\1\0\0\1\0\1\0\0"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + bytes(9)
    return b"\xff\xd8" + app0 + b"\xff\xff\xd0" + sof + b"\xff\xd9"


def _webp(chunk: bytes, body: bytes) -> bytes:
    inner = b"WEBP" + chunk + struct.pack("<I", len(body)) + body + b"\0" * (len(body) & 1)
    return b"RIFF" + struct.pack("<I", len(inner)) + inner


def webp_lossy(width: int = 320, height: int = 200) -> bytes:
    return _webp(b"VP8 ", b"\x10\x02\x00\x9d\x01\x2a" + struct.pack("<HH", width, height)
                 + bytes(10))


def webp_lossless(width: int = 64, height: int = 48) -> bytes:
    return _webp(b"VP8L", b"\x2f" + struct.pack("<I", (width - 1) | (height - 1) << 14)
                 + bytes(5))


def webp_extended(width: int = 1000, height: int = 70000) -> bytes:
    return _webp(b"VP8X", b"\x10\0\0\0" + (width - 1).to_bytes(3, "little")
                 + (height - 1).to_bytes(3, "little"))
