"""Small real image and video files, and probes that identify and measure them.

The image/video simulators return real files (RGB PNG, uncompressed AVI) so clients and
players can open what they get; the gateway meters generated media by probing the bytes.
Probes read hostile input with the bounded readers of containers.py and matroska.py and raise
`NotMedia`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from proxy.media.containers import Malformed, read_mp4, riff_chunks, uint
from proxy.media.matroska import ebml_doctype, read_ebml

ImageFormat = Literal["png", "jpeg", "webp", "gif"]
VideoFormat = Literal["mp4", "webm", "avi", "gif"]
Pixel = Callable[[int, int], tuple[int, int, int]]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_AVIF_HASINDEX, _AVIIF_KEYFRAME = 0x10, 0x10
# JPEG start-of-frame markers (C4 DHT, C8 JPG and CC DAC sit in the range but are not SOFs).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class NotMedia(ValueError):
    """Not a recognised image or video, or a broken one; the message is safe to show."""


@dataclass(frozen=True, slots=True)
class ImageInfo:
    format: ImageFormat
    width: int
    height: int


@dataclass(frozen=True, slots=True)
class VideoInfo:
    format: VideoFormat
    duration_s: float | None


# --- writers ------------------------------------------------------------------------------


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bytes(width: int, height: int, pixel: Pixel) -> bytes:
    """An 8-bit RGB PNG whose pixel (x, y) is `pixel(x, y)`."""
    if width < 1 or height < 1:
        raise ValueError("a PNG needs at least one pixel")
    raw = bytearray()
    for y in range(height):
        raw.append(0)  # filter type None for every scanline
        for x in range(width):
            raw += bytes(pixel(x, y))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour
    return (PNG_SIGNATURE + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(raw))
            + _png_chunk(b"IEND", b""))


def _chunk(cid: bytes, body: bytes) -> bytes:
    return cid + struct.pack("<I", len(body)) + body + b"\0" * (len(body) & 1)


def _riff_list(kind: bytes, body: bytes) -> bytes:
    return _chunk(b"LIST", kind + body)


def _dib(frame: bytes, width: int, height: int) -> bytes:
    """Top-down RGB rows to a bottom-up BGR DIB with rows padded to 4 bytes."""
    row_bytes = width * 3
    pad = b"\0" * (-row_bytes % 4)
    rows = []
    for y in reversed(range(height)):
        row = bytearray(frame[y * row_bytes : (y + 1) * row_bytes])
        row[0::3], row[2::3] = row[2::3], row[0::3]
        rows.append(bytes(row) + pad)
    return b"".join(rows)


def avi_bytes(frames: Sequence[bytes], width: int, height: int, fps: float) -> bytes:
    """An uncompressed (BI_RGB, 24-bit) RIFF AVI; each frame is width*height*3 RGB bytes,
    top-down. The layout is the classic one players expect: hdrl(avih, strl(strh, strf)),
    movi of '00db' chunks, then an idx1 index with offsets relative to the 'movi' fourcc."""
    if width < 1 or height < 1 or fps <= 0:
        raise ValueError("an AVI needs a positive size and frame rate")
    if any(len(f) != width * height * 3 for f in frames):
        raise ValueError("every frame must be width * height * 3 RGB bytes")
    rate = Fraction(fps).limit_denominator(1001)  # frames/s as dwRate / dwScale
    image_size = (width * 3 + 3) // 4 * 4 * height
    chunks, entries, offset = [], [], 4  # idx1 offsets count from the 'movi' fourcc
    for frame in frames:
        entries.append(b"00db" + struct.pack("<III", _AVIIF_KEYFRAME, offset, image_size))
        chunk = _chunk(b"00db", _dib(frame, width, height))
        chunks.append(chunk)
        offset += len(chunk)
    movi, index = b"".join(chunks), b"".join(entries)  # joined once: linear in the frames
    usec = round(1_000_000 / rate)
    avih = struct.pack("<14I", usec, round(image_size * rate), 0, _AVIF_HASINDEX, len(frames),
                       0, 1, image_size, width, height, 0, 0, 0, 0)
    strh = struct.pack("<4s4sIHHIIIIIIIIhhhh", b"vids", b"DIB ", 0, 0, 0, 0,
                       rate.denominator, rate.numerator, 0, len(frames), image_size,
                       0xFFFFFFFF, 0, 0, 0, width, height)
    # BITMAPINFOHEADER: positive height = bottom-up rows; compression 0 = BI_RGB.
    strf = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, image_size, 0, 0, 0, 0)
    hdrl = _riff_list(b"hdrl", _chunk(b"avih", avih)
                      + _riff_list(b"strl", _chunk(b"strh", strh) + _chunk(b"strf", strf)))
    body = b"AVI " + hdrl + _riff_list(b"movi", movi) + _chunk(b"idx1", index)
    return b"RIFF" + struct.pack("<I", len(body)) + body


# --- image probes -------------------------------------------------------------------------


def _jpeg_size(data: bytes) -> tuple[int, int]:
    pos = 2
    while pos + 4 <= len(data):  # every step moves forward
        if data[pos] != 0xFF:
            raise Malformed("JPEG marker expected")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _SOF:
            return uint(data, pos + 7, 2), uint(data, pos + 5, 2)
        if marker in (0xD9, 0xDA):
            break  # end of image or start of scan before any frame header
        if 0xD0 <= marker <= 0xD8 or marker == 0x01:
            pos += 2  # standalone markers carry no length
            continue
        length = uint(data, pos + 2, 2)
        if length < 2:
            raise Malformed("bad JPEG segment length")
        pos += 2 + length
    raise Malformed("JPEG has no frame header")


def _webp_size(data: bytes) -> tuple[int, int]:
    for cid, body, _ in riff_chunks(data, 12, len(data)):
        if cid == b"VP8 ":  # lossy: a keyframe's start code, then 14-bit sizes
            if data[body + 3 : body + 6] != b"\x9d\x01\x2a":
                raise Malformed("bad VP8 start code")
            return (uint(data, body + 6, 2, "little") & 0x3FFF,
                    uint(data, body + 8, 2, "little") & 0x3FFF)
        if cid == b"VP8L":  # lossless: signature byte, then 14-bit sizes minus one
            if uint(data, body, 1) != 0x2F:
                raise Malformed("bad VP8L signature")
            bits = uint(data, body + 1, 4, "little")
            return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        if cid == b"VP8X":  # extended: 24-bit canvas sizes minus one
            return uint(data, body + 4, 3, "little") + 1, uint(data, body + 7, 3, "little") + 1
        break
    raise Malformed("WebP has no image chunk")


def probe_image(data: bytes) -> ImageInfo:
    """Format and pixel size of a PNG, JPEG, WebP or GIF; `NotMedia` otherwise."""
    kind: ImageFormat
    try:
        if data[:8] == PNG_SIGNATURE:
            if data[12:16] != b"IHDR":
                raise Malformed("PNG does not start with IHDR")
            kind, width, height = "png", uint(data, 16, 4), uint(data, 20, 4)
        elif data[:3] == b"\xff\xd8\xff":
            kind, (width, height) = "jpeg", _jpeg_size(data)
        elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            kind, (width, height) = "webp", _webp_size(data)
        elif data[:6] in (b"GIF87a", b"GIF89a"):
            kind = "gif"
            width, height = uint(data, 6, 2, "little"), uint(data, 8, 2, "little")
        else:
            raise NotMedia("not a recognised image (png, jpeg, webp, gif)")
    except Malformed as exc:
        raise NotMedia(f"broken image: {exc}") from None
    if width == 0 or height == 0:
        raise NotMedia(f"{kind} image has no pixels")
    return ImageInfo(kind, width, height)


# --- video probes -------------------------------------------------------------------------


def _avi_duration(data: bytes) -> float | None:
    """The first video stream's dwLength x dwScale / dwRate (exact for rates like 30000/1001),
    else avih's total frames x microseconds per frame."""
    for cid, body, size in riff_chunks(data, 12, len(data)):
        if cid != b"LIST" or data[body : body + 4] != b"hdrl":
            continue
        usec = frames = None
        hdrl_end = min(body + size, len(data))
        for hid, hbody, _ in riff_chunks(data, body + 4, hdrl_end):
            if hid == b"avih":
                usec = uint(data, hbody, 4, "little")
                frames = uint(data, hbody + 16, 4, "little")
            elif hid == b"LIST" and data[hbody : hbody + 8] == b"strlstrh":
                # strh body: fccType at 0, dwScale at 20, dwRate at 24, dwLength at 32.
                strh = hbody + 12
                if data[strh : strh + 4] == b"vids":
                    scale = uint(data, strh + 20, 4, "little")
                    rate = uint(data, strh + 24, 4, "little")
                    if scale and rate:
                        return uint(data, strh + 32, 4, "little") * scale / rate
        if usec is None or frames is None:
            break
        return frames * usec / 1e6 if usec else None
    raise Malformed("AVI has no avih header")


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    """Past a GIF data sub-block chain (length-prefixed blocks ending with an empty one)."""
    while (size := uint(data, pos, 1)) != 0:
        pos += 1 + size
    return pos + 1


def _gif_duration(data: bytes) -> float | None:
    """Sum of the Graphic Control Extension delays (centiseconds); None if no frame has one."""
    packed = uint(data, 10, 1)
    pos = 13 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0)  # global colour table
    delay, timed = 0, False
    while pos < len(data):  # every step moves forward
        block = data[pos]
        if block == 0x3B:  # trailer
            break
        if block == 0x21:  # extension: label, then sub-blocks
            if uint(data, pos + 1, 1) == 0xF9:
                delay += uint(data, pos + 4, 2, "little")
                timed = True
            pos = _skip_sub_blocks(data, pos + 2)
        elif block == 0x2C:  # image: descriptor, optional local colour table, LZW data
            local = uint(data, pos + 9, 1)
            pos += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0)
            pos = _skip_sub_blocks(data, pos + 1)
        else:
            raise Malformed("bad GIF block")
    return delay / 100 if timed else None


def probe_video(data: bytes) -> VideoInfo:
    """Format and duration of an MP4, WebM/Matroska, AVI or GIF; `NotMedia` otherwise."""
    try:
        if data[4:8] == b"ftyp":
            return VideoInfo("mp4", read_mp4(data).duration_s)
        if data[:4] == b"\x1a\x45\xdf\xa3" and ebml_doctype(data) in ("webm", "matroska"):
            return VideoInfo("webm", read_ebml(data).duration_s)
        if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
            return VideoInfo("avi", _avi_duration(data))
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return VideoInfo("gif", _gif_duration(data))
    except Malformed as exc:
        raise NotMedia(f"broken video: {exc}") from None
    raise NotMedia("not a recognised video (mp4, webm, avi, gif)")
