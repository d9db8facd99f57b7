"""proxy.media.measure: the length of what a file carries. Honest files measure what their
headers state; lying headers (issue 30 #6) do not shorten the measure; junk is floored by its
bytes and measured in bounded time; hostile bytes end in NotAudio or a result."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.media.audio import NotAudio, probe
from proxy.media.measure import measure
from tests.support import media_builders as b
from tests.support.asr_audio import encoded, wav
from tests.support.encoded_media import Encoded


def test_honest_encoder_output_measures_what_it_states(encoded_audio: Encoded) -> None:
    got = measure(encoded_audio.data)
    stated = probe(encoded_audio.data).duration_s
    assert stated is not None and got.claimed_s == stated
    # AAC in MP4 counts its last frame whole (8 ms more than mvhd's edited length).
    assert stated <= got.seconds <= stated + 0.01
    assert got.floor_s < got.seconds


def test_wav_is_its_data_over_its_frame_size() -> None:
    assert measure(wav(2.5)).seconds == 2.5


def test_mp3_xing_claiming_one_frame_counts_every_frame() -> None:
    data = b.mp3_xing(1)[:384] + (b.MP3_HEADER + bytes(380)) * 2000
    got = measure(data)
    assert got.claimed_s == probe(data).duration_s == pytest.approx(0.024)
    assert got.seconds == 48.0  # 2000 frames of 1152 samples at 48 kHz; the Xing frame none


def test_mp3_frames_after_junk_are_found_again() -> None:
    data = b.mp3(10) + b"junk" * 100 + b.mp3(1000)
    assert measure(data).seconds == pytest.approx(1010 * 0.024)


def test_lame_delay_and_padding_are_taken_off() -> None:
    data = b.mp3_xing(3, lame=(576, 1000))
    assert measure(data).seconds == pytest.approx((3 * 1152 - 1576) / 48000)


@pytest.mark.parametrize("total", [0, 1, 16000])
def test_flac_counts_its_frames_not_its_streaminfo(total: int) -> None:
    data = bytearray(encoded("flac", 10.0))
    data[21] &= 0xF0
    data[22:26] = total.to_bytes(4, "big")
    assert measure(bytes(data)).seconds == 10.0


def test_junk_is_floored_by_its_bytes_in_bounded_time() -> None:
    junk = os.urandom(4_000_000)
    for head, floor in ((b.mp3(2), 4_000_000 * 8 / 320_000),
                        (b.flac(), 4_000_000 * 8 / (16000 * 16 * 1.1))):
        start = time.monotonic()
        got = measure(head + junk)
        assert got.seconds >= floor * 0.99 and time.monotonic() - start < 5
    start = time.monotonic()
    assert measure(b.flac() + b"\xff\xf8" * 2_000_000).seconds > 100
    assert measure(b.mp3(2) + b"\xff" * 4_000_000).seconds > 90
    assert time.monotonic() - start < 10


def test_counting_stops_past_the_limit() -> None:
    data = b.mp3(100_000)  # 2,400 s
    assert measure(data, at_most_s=60).seconds > 60


def test_ogg_takes_the_highest_granule() -> None:
    honest = b.ogg_vorbis(seconds=2.0)
    assert measure(honest).seconds == pytest.approx(2.0)
    ident, tail = honest[: honest.index(b"OggS", 4)], b.ogg_page(bytes(100), granule=441,
                                                                  seq=2, flags=4)
    lying = ident + b.ogg_page(bytes(100), granule=10 * 44100, seq=1) + tail
    assert probe(lying).duration_s == pytest.approx(0.01)
    assert measure(lying).seconds == pytest.approx(10.0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([b.flac(), b.mp3(8), b.mp3_xing(125), b.ogg_opus(), b.ogg_vorbis(),
                        b.m4a(), b.webm(), wav(0.1)]),
       st.integers(0, 400), st.binary(max_size=64))
def test_hostile_bytes_end_in_not_audio_or_a_length(valid: bytes, at: int, junk: bytes
                                                    ) -> None:
    with contextlib.suppress(NotAudio):
        got = measure(valid[:at] + junk + valid[at + len(junk):])
        assert got.seconds >= 0
