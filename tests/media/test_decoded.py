"""Decoded lengths (`decoded_length`): what FFmpeg's decoders put out where the container states
another duration: Opus in Ogg and WebM, AAC in MP4; checked against FFmpeg itself (PyAV)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from proxy.media.audio import decoded_length, probe
from proxy.media.containers import Decoded
from tests.support import media_builders as b
from tests.support.encoded_media import AUDIO_FORMATS, audio_clip, encode_audio, encoder, read_audio

DECODED_CODECS = {"ogg": "libopus", "webm": "libopus", "m4a": "aac"}


@pytest.mark.parametrize(("fmt", "rate"), [  # libopus takes 8, 12, 16, 24 or 48 kHz only
    *((fmt, rate) for fmt in ("ogg", "webm") for rate in (8000, 16000, 24000, 48000)),
    *(("m4a", rate) for rate in (8000, 16000, 22050, 44100, 48000)),
])
def test_decoded_length_is_what_ffmpeg_decodes(fmt: str, rate: int) -> None:
    codec = DECODED_CODECS[fmt]
    if encoder([codec]) is None:
        pytest.fail(f"this PyAV wheel has no {codec}")
    t = np.arange(round(1.7 * rate)) / rate
    pcm = np.round(np.sin(2 * np.pi * 330 * t) * 9000).astype("<i2")
    data = encode_audio(AUDIO_FORMATS[fmt][0], codec, pcm, rate)
    decoded = decoded_length(data)
    assert decoded is not None
    assert decoded.seconds == pytest.approx(read_audio(data).decoded_s, abs=1e-9)
    # Opus always decodes at 48 kHz; AAC at the rate its sample entry states.
    assert decoded.rate == (48000 if codec == "libopus" else rate)


def test_the_container_overstates_what_is_decoded() -> None:
    # The 3 s tone: AAC's last frame is decoded whole (1024 samples: 3.008 s at 16 kHz), while
    # WebM's Duration counts the last Opus block whole (3.008 s) and the decoder trims it.
    m4a, webm = audio_clip("m4a").data, audio_clip("webm").data
    assert probe(m4a).duration_s == pytest.approx(3.0)
    assert decoded_length(m4a) == Decoded(pytest.approx(3.008), 16000)
    assert probe(webm).duration_s == pytest.approx(3.008)
    assert decoded_length(webm) == Decoded(pytest.approx(3.0), 48000)


@pytest.mark.parametrize("data", [
    audio_clip("wav").data, audio_clip("mp3").data, audio_clip("flac").data, b.ogg_vorbis(),
    b.m4a(),  # a sound track without a sample table
    b"not audio",
])
def test_other_formats_and_codecs_have_none(data: bytes) -> None:
    assert decoded_length(data) is None


def _webm_opus(blocks: bytes, codec_delay_ns: int = 0) -> bytes:
    track = b.el(0xAE, b.el(0xD7, b"\1") + b.el(0x86, b"A_OPUS")
                 + b.el(0x56AA, codec_delay_ns.to_bytes(4, "big")))
    cluster = b.el(0x1F43B675, b.el(0xE7, b"\0") + blocks)
    return b.ebml_header() + b.el(0x18538067, b.el(0x1654AE6B, track) + cluster)


def _block(toc: int, track: int = 1, flags: int = 0x80) -> bytes:
    return bytes([0x80 | track]) + struct.pack(">hB", 0, flags) + bytes([toc, 0])


def test_webm_opus_counts_blocks_less_codec_delay_and_discard_padding() -> None:
    # CELT 20 ms (config 19), SILK 60 ms (config 3), two CELT 10 ms frames (config 18, code 1).
    simple = b"".join(b.el(0xA3, _block(toc)) for toc in (19 << 3, 3 << 3, 18 << 3 | 1))
    assert decoded_length(_webm_opus(simple)) == Decoded(pytest.approx(0.1), 48000)
    # The last block in a BlockGroup with 5 ms of DiscardPadding; a 6.5 ms CodecDelay; a
    # block of another track counts for nothing.
    group = b.el(0xA0, b.el(0xA1, _block(19 << 3)) + b.el(0x75A2, (5_000_000).to_bytes(4, "big")))
    other = b.el(0xA3, _block(19 << 3, track=2))
    data = _webm_opus(simple + other + group, codec_delay_ns=6_500_000)
    assert decoded_length(data) == Decoded(pytest.approx(0.12 - 0.0065 - 0.005), 48000)
    # Laced blocks hold several frames each: not counted, so no decoded length.
    laced = b.el(0xA3, _block(19 << 3, flags=0x82))
    assert decoded_length(_webm_opus(simple + laced)) is None
