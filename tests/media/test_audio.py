"""Audio identification by content and duration probing, on hand-built files of each format."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from proxy.media.audio import FORMATS, AudioInfo, NotAudio, probe, sniff
from proxy.media.wav import wav_bytes
from tests.support import media_builders as b
from tests.support.encoded_media import (
    TONE_RATE,
    TONE_SECONDS,
    Encoded,
    audio_clip,
    read_audio,
    tone,
)


def test_wav_duration_is_exact() -> None:
    data = wav_bytes(np.zeros(16000 * 3 * 2, "<i2").tobytes(), 16000, channels=2)
    assert probe(data) == AudioInfo("wav", 3.0, 16000, 2)


@pytest.mark.parametrize("data,expected", [
    (b.flac(), AudioInfo("flac", 3.0, 16000, 1)),
    (b.flac(rate=44100, channels=2, total=44100 // 2, id3=True), AudioInfo("flac", 0.5, 44100, 2)),
    (b.flac(total=0), AudioInfo("flac", None, 16000, 1)),
    (b.ogg_opus(), AudioInfo("ogg", 3.0, 48000, 1)),
    (b.ogg_opus(1.5, pre_skip=3840, channels=2), AudioInfo("ogg", 1.5, 48000, 2)),
    (b.ogg_vorbis(), AudioInfo("ogg", 2.0, 44100, 2)),
    (b.mp3(), AudioInfo("mp3", 3.0, 48000, 2)),
    (b.mp3(tag=True), AudioInfo("mp3", 3.0, 48000, 2)),
    (b.mp3(header=b.MP3_MONO_HEADER), AudioInfo("mp3", 3.0, 48000, 1)),
    (b.mp3(50) + b"TAG" + bytes(125), AudioInfo("mp3", 1.2, 48000, 2)),  # ID3v1 at the end
    (b.mp3_xing(125), AudioInfo("mp3", 3.0, 48000, 2)),
    (b.mp3_xing(250, b.MP3_MONO_HEADER), AudioInfo("mp3", 6.0, 48000, 1)),
    # A LAME tag's encoder delay and padding are not audio (ffprobe leaves them out too).
    (b.mp3_xing(125, lame=(576, 1152)), AudioInfo("mp3", 2.964, 48000, 2)),
    (b.m4a(), AudioInfo("m4a", 3.0, 44100, 2)),
    (b.m4a(1000, 2500, version=1), AudioInfo("m4a", 2.5, 44100, 2)),
    (b.m4a(moov_last=True), AudioInfo("m4a", 3.0, 44100, 2)),
    (b.webm(), AudioInfo("webm", 3.0, 48000, 1)),
    (b.webm(doctype=b"matroska", unknown_sizes=True), AudioInfo("webm", 3.0, 48000, 1)),
    (b.webm(1500.0, scale=2_000_000), AudioInfo("webm", 3.0, 48000, 1)),
    # MediaRecorder output has no Duration: the last block's timestamp stands in.
    (b.webm(None), AudioInfo("webm", 2.98, 48000, 1)),
    (b.webm(None, unknown_sizes=True), AudioInfo("webm", 2.98, 48000, 1)),
    (b.webm(None, blocks=()), AudioInfo("webm", None, 48000, 1)),
])
def test_probe_measures_each_format(data: bytes, expected: AudioInfo) -> None:
    assert sniff(data) == expected.format
    info = probe(data)
    assert info.duration_s == pytest.approx(expected.duration_s)
    assert (info.format, info.sample_rate, info.channels) == (
        expected.format, expected.sample_rate, expected.channels)


def test_mp3_frame_sizes_follow_the_layer_and_version() -> None:
    # MPEG-2 Layer III, 64 kbps, 24 kHz, padded: 72 * 64000 / 24000 + 1 = 193 bytes, 576 samples.
    frame = b"\xff\xf3\x86\xc0" + bytes(189)
    assert probe(frame * 100).duration_s == pytest.approx(100 * 576 / 24000)
    # MPEG-1 Layer II, 192 kbps, 48 kHz: 576 bytes, 1152 samples.
    layer2 = b"\xff\xfd\xa4\x00" + bytes(572)
    assert probe(layer2 * 10).duration_s == pytest.approx(0.24)
    # MPEG-2.5 Layer III, 8 kbps, 8 kHz: 72 bytes, 576 samples.
    tiny = b"\xff\xe3\x18\xc0" + bytes(68)
    assert probe(tiny * 1000).duration_s == pytest.approx(72.0)


def test_mp3_walk_stops_at_a_cut_off_frame() -> None:
    assert probe(b.mp3(10) + b.MP3_HEADER + bytes(100)).duration_s == pytest.approx(0.24)


def test_unknown_ogg_codec_has_no_duration() -> None:
    data = b.ogg_page(b"\x80theora" + bytes(40), granule=0, seq=0, flags=2)
    assert probe(data) == AudioInfo("ogg", None, None, None)


def test_fragmented_mp4_uses_mehd_or_reports_unknown() -> None:
    mehd = b.box(b"mehd", bytes(4) + struct.pack(">I", 4000))
    moov = b.box(b"moov", b.mvhd(1000, 0) + b.box(b"mvex", mehd))
    data = b.box(b"ftyp", b"iso5\0\0\0\0iso5") + moov
    assert probe(data).duration_s == 4.0
    bare = b.box(b"ftyp", b"iso5\0\0\0\0") + b.box(b"moov", b.mvhd(1000, 0) + b.box(b"mvex", b""))
    assert probe(bare).duration_s is None


@pytest.mark.parametrize("data", [
    b"", b"hello world, this is plain text and not audio at all" * 20, bytes(1000),
    b"\xff\xfb\x94\x00" + b"x" * 1000,  # one MP3-looking header, no second frame
    b"\xff" * 4096, b"<html><body>RIFF WAVE</body></html>", b"PK\x03\x04" + bytes(100),
    b"\x89PNG\r\n\x1a\n" + bytes(100), b"ID3\x04\0\0\0\0\0\x05hello",
    b"\x1a\x45\xdf\xa3\x84\x42\x82\x81x",  # EBML with an unknown doctype
])
def test_non_audio_is_not_sniffed(data: bytes) -> None:
    assert sniff(data) is None
    with pytest.raises(NotAudio):
        probe(data)


@pytest.mark.parametrize("data", [
    b"RIFF\0\0\0\0WAVEfmt ", b.flac()[:20], b"OggS" + bytes(10),
    b.box(b"ftyp", b"M4A ") + b.box(b"free", b""), b.ebml_header(),
    b.box(b"ftyp", b"M4A ") + b.box(b"moov", b.mvhd(0, 10)),  # timescale 0
    b.box(b"ftyp", b"M4A ") + b"\0\0\0\x04moov",  # box smaller than its header
    b.ogg_page(b"OpusHead" + bytes(11), granule=0, seq=0),  # zero channels
    b.id3_tag(bytes(4)) + b.MP3_HEADER + bytes(10),  # a tagged but cut-off first frame
])
def test_broken_containers_raise_not_audio(data: bytes) -> None:
    assert sniff(data) is not None
    with pytest.raises(NotAudio):
        probe(data)


def test_formats_lists_every_sniffable_format() -> None:
    samples = [wav_bytes(b"", 8000), b.mp3(), b.m4a(), b.webm(), b.flac(), b.ogg_opus()]
    assert tuple(sniff(s) for s in samples) == FORMATS


def test_encoded_clips_measure_like_ffmpeg(encoded_audio: Encoded) -> None:
    """FFmpeg's muxers, read back by FFmpeg's demuxers: the probe agrees to 50 ms on each."""
    data = encoded_audio.data
    info = probe(data)
    ffmpeg = read_audio(data)
    assert info.format == sniff(data) == encoded_audio.format
    assert info.duration_s is not None
    # MP3: the LAME tag's delay and padding are left out, as FFmpeg does. Ogg Opus: the
    # pre-skip is left out (FFmpeg's duration keeps it: 3.0065 s). WebM: Segment/Duration.
    assert info.duration_s == pytest.approx(ffmpeg.duration_s, abs=0.05)
    assert info.duration_s == pytest.approx(ffmpeg.decoded_s, abs=0.05)
    assert info.duration_s == pytest.approx(TONE_SECONDS, abs=0.05)
    assert info.channels == ffmpeg.channels == 1
    # Ogg Opus granules count 48 kHz samples whatever the input rate; the rest declare 16 kHz.
    opus_in_ogg = encoded_audio.format == "ogg" and encoded_audio.codec == "libopus"
    assert info.sample_rate == (48000 if opus_in_ogg else TONE_RATE)


def test_mp3_without_a_xing_frame_counts_every_frame() -> None:
    """Written to a pipe, FFmpeg cannot go back for the Xing/LAME frame: the frames then hold
    the encoder delay and padding too, and FFmpeg counts them all just the same."""
    with_tag = audio_clip("mp3").data
    first = with_tag.index(b"Xing") if b"Xing" in with_tag else with_tag.index(b"Info")
    assert first < 200  # the first frame carries the tag (after an ID3v2 header)
    pipe = Pipe()
    with av.open(pipe, "w", format="mp3") as out:
        stream = out.add_stream(audio_clip("mp3").codec, rate=TONE_RATE)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(tone().reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = TONE_RATE
        out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    data = bytes(pipe.written)
    assert b"Xing" not in data and b"Info" not in data
    info = probe(data)
    assert info.duration_s is not None and info.duration_s > TONE_SECONDS + 0.03
    # 576-sample frames at 16 kHz: whole frames, exactly what FFmpeg decodes.
    assert round(info.duration_s * TONE_RATE) % 576 == 0
    assert info.duration_s == pytest.approx(read_audio(data).decoded_s, abs=1e-9)
    assert info.duration_s == pytest.approx(read_audio(data).duration_s, abs=1e-3)


class Pipe(io.RawIOBase):
    """A write-only, unseekable stream: what FFmpeg sees when it writes to stdout."""

    def __init__(self) -> None:
        self.written = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:
        self.written += data
        return len(data)
