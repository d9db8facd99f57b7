"""Image and video writers and probes."""

from __future__ import annotations

import io
import struct
import zlib

import av
import pytest

from proxy.media.visual import (
    ImageInfo,
    NotMedia,
    VideoInfo,
    avi_bytes,
    png_bytes,
    probe_image,
    probe_video,
)
from tests.support import media_builders as b
from tests.support.encoded_media import VIDEO_FRAMES, VIDEO_SECONDS, VIDEO_SIZE, Encoded, read_video


def gradient(x: int, y: int) -> tuple[int, int, int]:
    return (x * 40) % 256, (y * 60) % 256, 128


def rgb_frames(count: int, width: int, height: int) -> list[bytes]:
    return [bytes((i * 20 + x + y) % 256 for y in range(height) for x in range(width)
                  for _ in range(3)) for i in range(count)]


def test_png_round_trip_and_pixels() -> None:
    data = png_bytes(5, 3, gradient)
    assert probe_image(data) == ImageInfo("png", 5, 3)
    # IDAT holds filter byte 0 then RGB triples, top row first.
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4 : idat])[0]
    raw = zlib.decompress(data[idat + 4 : idat + 4 + length])
    assert raw[:1] == b"\0" and raw[1 + 3 * 4 : 1 + 3 * 5] == bytes(gradient(4, 0))
    for at in (data.index(b"IHDR"), idat, data.index(b"IEND")):
        size = struct.unpack(">I", data[at - 4 : at])[0]
        crc = struct.unpack(">I", data[at + 4 + size : at + 8 + size])[0]
        assert crc == zlib.crc32(data[at : at + 4 + size])
    with pytest.raises(ValueError):
        png_bytes(0, 1, gradient)


@pytest.mark.parametrize("data,expected", [
    (b.jpeg(640, 480), ImageInfo("jpeg", 640, 480)),
    (b.webp_lossy(), ImageInfo("webp", 320, 200)),
    (b.webp_lossless(), ImageInfo("webp", 64, 48)),
    (b.webp_extended(), ImageInfo("webp", 1000, 70000)),
    (b.gif(7, 9), ImageInfo("gif", 7, 9)),
])
def test_probe_image_formats(data: bytes, expected: ImageInfo) -> None:
    assert probe_image(data) == expected


def test_avi_round_trip() -> None:
    data = avi_bytes(rgb_frames(12, 5, 3), 5, 3, 6)
    info = probe_video(data)
    assert info.format == "avi" and info.duration_s == pytest.approx(2.0, abs=1e-5)
    assert probe_video(avi_bytes([], 2, 2, 25)) == VideoInfo("avi", 0.0)
    # Without a video stream header, avih's frames x microseconds per frame (166667) count.
    no_strh = data.replace(b"vidsDIB ", b"audsDIB ")
    assert probe_video(no_strh).duration_s == 12 * 166667 / 1e6


def test_avi_layout_follows_the_spec() -> None:
    width, height = 5, 3
    frames = rgb_frames(2, width, height)
    data = avi_bytes(frames, width, height, 6)
    assert data[:4] == b"RIFF" and data[8:12] == b"AVI "
    assert struct.unpack_from("<I", data, 4)[0] == len(data) - 8
    hdrl = data.index(b"hdrl")
    assert data[hdrl + 4 : hdrl + 8] == b"avih"
    assert struct.unpack_from("<I", data, hdrl + 8)[0] == 56
    strh = data.index(b"strh")
    assert data[strh + 8 : strh + 16] == b"vidsDIB "
    scale, rate = struct.unpack_from("<II", data, strh + 8 + 20)
    assert rate / scale == 6
    strf = data.index(b"strf")
    header = struct.unpack_from("<IiiHHI", data, strf + 8)
    assert header == (40, width, height, 1, 24, 0)
    movi = data.index(b"movi")
    stride = 16  # 5 pixels * 3 bytes, padded to 4
    first = data.index(b"00db", movi)
    assert struct.unpack_from("<I", data, first + 4)[0] == stride * height
    dib = data[first + 8 : first + 8 + stride * height]
    # Bottom-up rows, BGR order: the DIB's first row is the frame's last, colours swapped.
    last_row = frames[0][(height - 1) * width * 3 : height * width * 3]
    assert dib[:3] == last_row[2::-1] and dib[15:16] == b"\0"
    idx1 = data.index(b"idx1")
    entries = [struct.unpack_from("<4sIII", data, idx1 + 8 + 16 * i) for i in range(2)]
    assert entries[0] == (b"00db", 0x10, first - movi, stride * height)
    assert data[movi + entries[1][2] : movi + entries[1][2] + 4] == b"00db"


@pytest.mark.parametrize("bad", [b"", b"x" * 100, bytes(2)])
def test_avi_writer_rejects_bad_input(bad: bytes) -> None:
    with pytest.raises(ValueError):
        avi_bytes([bad], 2, 2, 6)
    with pytest.raises(ValueError):
        avi_bytes([], 2, 2, 0)


def test_fractional_frame_rates() -> None:
    data = avi_bytes(rgb_frames(30, 2, 2), 2, 2, 30000 / 1001)
    assert probe_video(data).duration_s == pytest.approx(30 * 1001 / 30000, abs=1e-5)


@pytest.mark.parametrize("data,expected", [
    (b.m4a(), VideoInfo("mp4", 3.0)),
    (b.webm(), VideoInfo("webm", 3.0)),
    (b.webm(None, doctype=b"matroska", unknown_sizes=True), VideoInfo("webm", 2.98)),
    (b.gif(delays=(10, 25, 5)), VideoInfo("gif", 0.4)),
    (b.gif(delays=()), VideoInfo("gif", None)),
])
def test_probe_video_formats(data: bytes, expected: VideoInfo) -> None:
    assert probe_video(data) == expected


@pytest.mark.parametrize("data", [
    b"", b"hello", bytes(100), b"\x89PNG\r\n\x1a\n" + bytes(8), b"\xff\xd8\xff\xe0\x00",
    b"\xff\xd8\xff\xd9", b"RIFF\0\0\0\0WEBPVP8 \x10\0\0\0" + bytes(16), b"GIF89a\0\0\0\0",
    b"RIFF\0\0\0\0WEBPVP8L\x05\0\0\0\x00\0\0\0\0", png_bytes(1, 1, gradient)[:20],
])
def test_garbage_is_not_an_image(data: bytes) -> None:
    with pytest.raises(NotMedia):
        probe_image(data)


@pytest.mark.parametrize("data", [
    b"", b"plain text", b.flac(), b"RIFF\0\0\0\0AVI LIST\4\0\0\0movi", b"GIF89a\1\0\1\0\0\0\0!",
    b.box(b"ftyp", b"isom"), b"\x1a\x45\xdf\xa3\x80", b"RIFF\0\0\0\0WAVE",
    b"GIF89a\1\0\1\0\0\0\0\x99",
])
def test_garbage_is_not_a_video(data: bytes) -> None:
    with pytest.raises(NotMedia):
        probe_video(data)


def test_ffmpeg_decodes_the_avi() -> None:
    """FFmpeg's AVI demuxer and raw video decoder (through PyAV) read what avi_bytes writes:
    the frame count, rate and size, and every pixel, colours and row order included."""
    width, height = 6, 4
    frames = [bytes(c for y in range(height) for x in range(width)
                    for c in (i * 20 + x, y * 60, 255 - x)) for i in range(12)]
    with av.open(io.BytesIO(avi_bytes(frames, width, height, 6))) as container:
        assert container.format.name == "avi"
        stream = container.streams.video[0]
        assert stream.codec_context.name == "rawvideo"
        assert (stream.frames, stream.average_rate) == (12, 6)
        assert container.duration == 2 * av.time_base
        decoded = list(container.decode(stream))
    assert len(decoded) == 12
    assert [float(f.time or 0) for f in decoded] == pytest.approx([i / 6 for i in range(12)])
    for frame, rgb in zip(decoded, frames, strict=True):
        assert (frame.width, frame.height) == (width, height)
        assert frame.to_ndarray(format="rgb24").tobytes() == rgb
    # Pixel (x, y) = (5, 2) of frame 3: red 3 * 20 + 5, green 2 * 60, blue 255 - 5.
    assert decoded[3].to_ndarray(format="rgb24")[2, 5].tolist() == [65, 120, 250]


def test_ffmpeg_decodes_the_png() -> None:
    with av.open(io.BytesIO(png_bytes(5, 3, gradient))) as container:
        assert container.streams.video[0].codec_context.name == "png"
        image = next(container.decode(video=0))
    assert (image.width, image.height, image.format.name) == (5, 3, "rgb24")
    pixels = image.to_ndarray(format="rgb24")
    assert pixels[2, 4].tolist() == list(gradient(4, 2)) == [160, 120, 128]
    assert [[tuple(p) for p in row] for row in pixels.tolist()] == [
        [gradient(x, y) for x in range(5)] for y in range(3)]


def test_probe_video_on_encoder_output(encoded_videos: tuple[Encoded, ...]) -> None:
    """FFmpeg's mp4 and webm muxers with each available codec: the probe agrees with FFmpeg."""
    for clip in encoded_videos:
        ffmpeg = read_video(clip.data)
        assert (ffmpeg.frames, ffmpeg.size) == (VIDEO_FRAMES, VIDEO_SIZE), clip.codec
        info = probe_video(clip.data)
        assert info.format == clip.format, clip.codec
        assert info.duration_s == pytest.approx(ffmpeg.duration_s, abs=0.05), clip.codec
        assert info.duration_s == pytest.approx(VIDEO_SECONDS, abs=0.05), clip.codec
        with pytest.raises(NotMedia):
            probe_image(clip.data)
