"""Hostile input: random bytes, truncations and corruptions of valid files must end in the
module's own error (NotAudio, BadAudio, NotMedia) or a result, never a crash or a hang."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.media.audio import NotAudio, decoded_length, probe, sniff
from proxy.media.visual import NotMedia, avi_bytes, png_bytes, probe_image, probe_video
from proxy.media.wav import BadAudio, is_speech_wav, read_wav, to_speech_wav, wav_bytes
from tests.support import media_builders as b
from tests.support.encoded_media import audio_clip

# By name: a parametrized test's ids must be the same in every xdist worker, and an encoder's
# output is not (an Ogg stream's serial number is random).
FIXTURES = {
    "wav": wav_bytes(bytes(400), 16000, channels=2), "flac": b.flac(),
    "flac-id3": b.flac(id3=True), "ogg-opus": b.ogg_opus(), "ogg-vorbis": b.ogg_vorbis(),
    "mp3": b.mp3(8), "mp3-tag": b.mp3(4, tag=True), "mp3-xing": b.mp3_xing(125), "m4a": b.m4a(),
    "m4a-v1": b.m4a(version=1), "m4a-moov-last": b.m4a(moov_last=True), "webm": b.webm(),
    "webm-unknown-sizes": b.webm(None, unknown_sizes=True),
    "png": png_bytes(3, 2, lambda x, y: (x, y, 0)), "avi": avi_bytes([bytes(12)] * 2, 2, 2, 6),
    "gif": b.gif(), "jpeg": b.jpeg(5, 7), "webp-lossy": b.webp_lossy(),
    "webp-lossless": b.webp_lossless(), "webp-extended": b.webp_extended(),
    # Real encoder output: sample tables, edit lists, Opus packets and blocks to corrupt.
    "ffmpeg-m4a": audio_clip("m4a").data, "ffmpeg-ogg": audio_clip("ogg").data,
    "ffmpeg-webm": audio_clip("webm").data,
}
VALID = list(FIXTURES.values())
HOSTILE = settings(max_examples=400, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])


def check(data: bytes) -> None:
    """Every entry point either answers or raises its documented error."""
    sniff(data)
    is_speech_wav(data)
    calls: list[tuple[Callable[[bytes], object], type[Exception]]] = [
        (probe, NotAudio), (decoded_length, NotAudio), (read_wav, BadAudio),
        (to_speech_wav, BadAudio), (probe_image, NotMedia), (probe_video, NotMedia),
    ]
    for call, allowed in calls:
        with contextlib.suppress(allowed):
            call(data)


@HOSTILE
@given(st.binary(max_size=4096))
def test_random_bytes(data: bytes) -> None:
    check(data)


@HOSTILE
@given(st.sampled_from(VALID), st.binary(min_size=0, max_size=64))
def test_random_bytes_behind_valid_magic(valid: bytes, tail: bytes) -> None:
    for cut in (4, 8, 12, 16, 32):
        check(valid[:cut] + tail)


@HOSTILE
@given(st.sampled_from(VALID), st.data())
def test_truncations(valid: bytes, data: st.DataObject) -> None:
    check(valid[: data.draw(st.integers(0, len(valid)))])


@HOSTILE
@given(st.sampled_from(VALID), st.data())
def test_corruptions(valid: bytes, data: st.DataObject) -> None:
    mutated = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(mutated) - 1))
        mutated[at] = data.draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF,
                                                 data.draw(st.integers(0, 255))]))
    check(bytes(mutated))


@pytest.mark.parametrize("data", VALID, ids=list(FIXTURES))
def test_every_valid_fixture_is_recognised(data: bytes) -> None:
    results = 0
    for call in (probe, probe_image, probe_video):
        try:
            call(data)
            results += 1
        except (NotAudio, NotMedia):
            pass
    assert results >= 1


def test_nested_unknown_sizes_and_deep_boxes_stay_bounded() -> None:
    # Thousands of nested unknown-size EBML elements and MP4 boxes: no recursion, no hang.
    started = time.monotonic()
    ebml = b.ebml_header() + (b"\x18\x53\x80\x67" + b.UNKNOWN) * 5000
    assert probe(ebml).duration_s is None
    clusters = b.ebml_header() + b"\x18\x53\x80\x67" + b.UNKNOWN + (
        b"\x1f\x43\xb6\x75" + b.UNKNOWN + b"\xe7\x81\x01") * 50_000
    assert probe(clusters).duration_s is None  # element budget spent, no hang
    deep = b.box(b"ftyp", b"M4A ")
    for _ in range(50):
        deep = deep + b.box(b"moov", deep[-64:])
    check(deep)
    many = b.box(b"ftyp", b"M4A ") + b.box(b"free", b"") * 20_000
    with pytest.raises(NotAudio):
        probe(many)
    assert time.monotonic() - started < 10
