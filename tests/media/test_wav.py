"""WAV reading, canonical writing and the TTS output rule (protocols.md §7.4)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from proxy.media.wav import (
    SPEECH_RATE,
    BadAudio,
    Pcm,
    is_speech_wav,
    read_wav,
    to_speech_wav,
    wav_bytes,
)

SILENCE_HEADER = bytes.fromhex(
    "52 49 46 46 a4 bb 00 00 57 41 56 45 66 6d 74 20 10 00 00 00 01 00 01 00 c0 5d 00 00 "
    "80 bb 00 00 02 00 10 00 64 61 74 61 80 bb 00 00"
)


def riff(*chunks: tuple[bytes, bytes], riff_size: int | None = None,
         sizes: dict[bytes, int] | None = None) -> bytes:
    """A RIFF/WAVE file from (id, body) chunks, padding odd bodies; sizes can be overridden."""
    body = b"WAVE"
    for cid, data in chunks:
        size = (sizes or {}).get(cid, len(data))
        body += cid + struct.pack("<I", size) + data + b"\0" * (len(data) & 1)
    return b"RIFF" + struct.pack("<I", len(body) if riff_size is None else riff_size) + body


def fmt(tag: int = 1, channels: int = 1, rate: int = 24000, bits: int = 16) -> bytes:
    align = channels * bits // 8
    return struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)


def extensible(sub: int, channels: int, rate: int, bits: int) -> bytes:
    guid = struct.pack("<H", sub) + bytes.fromhex("000000001000800000aa00389b71")
    return fmt(0xFFFE, channels, rate, bits) + struct.pack("<HHI", 22, bits, 0) + guid


def tone(n: int, rate: int = SPEECH_RATE, hz: float = 440.0) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * hz * np.arange(n) / rate)


def test_one_second_of_silence_has_the_documented_header() -> None:
    out = wav_bytes(bytes(48000), SPEECH_RATE)
    assert out[:44] == SILENCE_HEADER
    assert len(out) == 44 + 48000
    assert is_speech_wav(out)


def test_wav_bytes_round_trips_through_read_wav() -> None:
    samples = bytes(range(256)) * 6
    pcm = read_wav(wav_bytes(samples, 16000, channels=2, bits=24))
    assert pcm == Pcm(16000, 2, 24, False, samples)
    assert pcm.duration_s == len(samples) / 6 / 16000


def test_wav_bytes_pads_odd_8_bit_data_and_refuses_partial_frames() -> None:
    out = wav_bytes(b"\x80\x80\x80", 8000, bits=8)
    assert len(out) == 44 + 4 and struct.unpack_from("<I", out, 4)[0] == 36 + 4
    assert read_wav(out).data == b"\x80\x80\x80"
    with pytest.raises(ValueError):
        wav_bytes(b"\0\0\0", 24000)


def test_read_wav_walks_list_fact_and_odd_sized_chunks() -> None:
    data = riff((b"LIST", b"INFOabc"), (b"fmt ", fmt(rate=16000)), (b"fact", b"\1\0\0\0"),
                (b"junk", b"x"), (b"data", bytes(3200)), (b"LIST", b"trailing"))
    pcm = read_wav(data)
    assert (pcm.rate, pcm.channels, pcm.bits, pcm.duration_s) == (16000, 1, 16, 0.1)


@pytest.mark.parametrize("riff_size,data_size", [
    (0xFFFFFFFF, 0xFFFFFFFF), (0, 0), (36 + 4800, 0xFFFFFFFF), (36 + 4800, 10**6),
    (0xFFFFFFFF, 100),
])
def test_placeholder_and_overlong_sizes_read_the_data_to_eof(riff_size: int,
                                                             data_size: int) -> None:
    data = riff((b"fmt ", fmt()), (b"data", bytes(4801)), riff_size=riff_size,
                sizes={b"data": data_size})
    pcm = read_wav(data[:-1])  # drop the pad byte: 4801 bytes end on half a frame
    assert len(pcm.data) == 4800 and pcm.duration_s == 0.1
    assert not is_speech_wav(data[:-1])
    fixed = to_speech_wav(data[:-1])
    assert fixed == wav_bytes(bytes(4800), SPEECH_RATE) and is_speech_wav(fixed)


def test_float_and_extensible_formats() -> None:
    x = np.array([0.0, 0.5, -0.5, 1.0], dtype="<f4")
    pcm = read_wav(riff((b"fmt ", fmt(3, 1, 24000, 32)), (b"data", x.tobytes())))
    assert pcm.float_ and pcm.bits == 32
    out = read_wav(to_speech_wav(riff((b"fmt ", fmt(3, 1, 24000, 32)), (b"data", x.tobytes()))))
    assert list(np.frombuffer(out.data, "<i2")) == [0, 16384, -16384, 32767]
    ext = riff((b"fmt ", extensible(1, 2, 48000, 24)), (b"data", bytes(6 * 480)))
    assert read_wav(ext).channels == 2 and read_wav(ext).duration_s == 0.01
    ext_float = riff((b"fmt ", extensible(3, 1, 8000, 64)), (b"data", bytes(8 * 80)))
    assert read_wav(ext_float).float_


@pytest.mark.parametrize("data,message", [
    (b"", "RIFF"), (b"RIFX" + bytes(40), "RIFF"), (b"RIFF\0\0\0\0AVI " + bytes(40), "RIFF"),
    (riff((b"data", bytes(10))), "fmt"), (riff((b"fmt ", fmt())), "data"),
    (riff((b"fmt ", fmt(rate=0)), (b"data", bytes(4))), "rate"),
    (riff((b"fmt ", fmt(tag=2)), (b"data", bytes(4))), "format"),
    (riff((b"fmt ", fmt(bits=12)), (b"data", bytes(4))), "sample size"),
    (riff((b"fmt ", fmt(tag=3, bits=16)), (b"data", bytes(4))), "sample size"),
    (riff((b"fmt ", fmt(channels=9)), (b"data", bytes(18))), "channel"),
    (riff((b"fmt ", fmt()[:10]), (b"data", bytes(4))), "fmt"),
    (riff((b"fmt ", extensible(0x55, 1, 8000, 16)), (b"data", bytes(4))), "format"),
])
def test_unreadable_wavs_raise_bad_audio(data: bytes, message: str) -> None:
    with pytest.raises(BadAudio, match=message):
        read_wav(data)
    assert not is_speech_wav(data)


def test_speech_wav_keeps_its_samples_byte_for_byte() -> None:
    samples = (tone(2400) * 32767).astype("<i2").tobytes()
    canonical = wav_bytes(samples, SPEECH_RATE)
    assert to_speech_wav(canonical) == canonical
    with_list = riff((b"fmt ", fmt()), (b"LIST", b"INFO"), (b"data", samples))
    assert is_speech_wav(with_list)
    assert to_speech_wav(with_list) == canonical
    assert to_speech_wav(samples, source="pcm") == canonical
    assert to_speech_wav(samples + b"\x01", source="pcm") == canonical  # half a sample dropped


def test_is_speech_wav_demands_consistent_sizes() -> None:
    good = wav_bytes(bytes(100), SPEECH_RATE)
    assert is_speech_wav(good)
    assert not is_speech_wav(good + b"\0\0")  # RIFF size no longer matches
    assert not is_speech_wav(good[:4] + b"\xff\xff\xff\xff" + good[8:])
    assert not is_speech_wav(wav_bytes(bytes(100), 22050))
    assert not is_speech_wav(wav_bytes(bytes(200), SPEECH_RATE, channels=2))
    assert not is_speech_wav(b"not a wav")


@pytest.mark.parametrize("rate,frames", [(22050, 22050), (16000, 1600), (48000, 4801),
                                         (44100, 1), (8000, 0), (96000, 7)])
def test_resampled_length_is_exact(rate: int, frames: int) -> None:
    samples = (tone(frames, rate) * 32767).astype("<i2").tobytes()
    out = read_wav(to_speech_wav(wav_bytes(samples, rate)))
    assert (out.rate, out.channels, out.bits) == (SPEECH_RATE, 1, 16)
    assert out.frames == round(frames * SPEECH_RATE / rate)


def test_pcm_at_piper_rate_is_resampled() -> None:
    samples = (tone(22050, 22050) * 32767).astype("<i2").tobytes()
    out = read_wav(to_speech_wav(samples, source="pcm", pcm_rate=22050))
    assert out.frames == SPEECH_RATE
    y = np.frombuffer(out.data, "<i2") / 32768.0
    # Still a 440 Hz tone of amplitude 0.5 after linear interpolation.
    assert np.max(np.abs(y - tone(SPEECH_RATE))) < 0.01


def test_stereo_is_downmixed_by_mean_and_8_bit_is_recentred() -> None:
    left, right = np.full(4, 16384, "<i2"), np.full(4, -8192, "<i2")
    stereo = np.column_stack([left, right]).astype("<i2").tobytes()
    out = read_wav(to_speech_wav(wav_bytes(stereo, SPEECH_RATE, channels=2)))
    assert list(np.frombuffer(out.data, "<i2")) == [4096] * 4
    eight = read_wav(to_speech_wav(wav_bytes(bytes([128, 255, 0, 192]), SPEECH_RATE, bits=8)))
    assert list(np.frombuffer(eight.data, "<i2")) == [0, 32512, -32768, 16384]


def test_24_and_32_bit_samples_keep_their_sign() -> None:
    s24 = b"".join(v.to_bytes(3, "little", signed=True) for v in (0, 1 << 22, -(1 << 22)))
    out = read_wav(to_speech_wav(wav_bytes(s24, SPEECH_RATE, bits=24)))
    assert list(np.frombuffer(out.data, "<i2")) == [0, 16384, -16384]
    s32 = np.array([0, 1 << 30, -(1 << 31)], "<i4").tobytes()
    out = read_wav(to_speech_wav(wav_bytes(s32, SPEECH_RATE, bits=32)))
    assert list(np.frombuffer(out.data, "<i2")) == [0, 16384, -32768]


def test_float_out_of_range_and_nan_are_clipped() -> None:
    x = np.array([2.0, -3.0, np.nan, np.inf], dtype="<f8")
    out = read_wav(to_speech_wav(riff((b"fmt ", fmt(3, 1, 24000, 64)), (b"data", x.tobytes()))))
    assert list(np.frombuffer(out.data, "<i2")) == [32767, -32768, 0, 32767]


def test_to_speech_wav_rejects_unknown_sources_and_rates() -> None:
    with pytest.raises(ValueError):
        to_speech_wav(b"", source="mp3")
    with pytest.raises(BadAudio):
        to_speech_wav(bytes(10), source="pcm", pcm_rate=0)
    with pytest.raises(BadAudio):
        to_speech_wav(b"ID3 not a wav")
