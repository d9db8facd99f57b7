"""WAV (RIFF/WAVE) reading, canonical writing, and the gateway's TTS output rule.

The gateway's speech output is always 16-bit PCM, mono, 24 kHz behind the canonical 44-byte
header (protocols.md §7.4). Upstreams send other rates (Piper 22.05 kHz), stereo, float WAV or
headerless PCM, and streaming producers leave placeholder sizes in the header; `to_speech_wav`
turns all of those into the one shape clients get.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from proxy.media.containers import riff_chunks

if TYPE_CHECKING:  # numpy is imported where audio is converted: 12 MB a worker rarely needs
    import numpy as np
    import numpy.typing as npt

SPEECH_RATE = 24000
MAX_CHANNELS = 8
# Slower than 1 kHz is nothing real; the floor also caps resampling's growth at 24x.
MIN_RATE, MAX_RATE = 1000, 768_000

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
_PCM_BITS = (8, 16, 24, 32)
_FLOAT_BITS = (32, 64)
# Sizes a streaming producer writes before it knows the length.
_PLACEHOLDERS = (0, 0xFFFFFFFF)
_FMT = struct.Struct("<HHIIHH")


class BadAudio(ValueError):
    """The bytes are not a WAV this module can read; the message is safe to show a client."""


@dataclass(frozen=True, slots=True)
class Pcm:
    """Interleaved little-endian samples exactly as stored in the file."""

    rate: int
    channels: int
    bits: int
    float_: bool
    data: bytes

    @property
    def frame_bytes(self) -> int:
        return self.channels * self.bits // 8

    @property
    def frames(self) -> int:
        return len(self.data) // self.frame_bytes

    @property
    def duration_s(self) -> float:
        return self.frames / self.rate


@dataclass(frozen=True, slots=True)
class _Layout:
    """What the chunk walk found, including whether every size field told the truth."""

    pcm: Pcm
    tag: int
    byte_rate: int
    block_align: int
    sizes_exact: bool


def _parse_fmt(data: bytes, body: int, size: int) -> tuple[int, int, int, int, int, int]:
    if size < 16 or body + 16 > len(data):
        raise BadAudio("WAV fmt chunk is truncated")
    tag, channels, rate, byte_rate, block_align, bits = _FMT.unpack_from(data, body)
    if tag == _EXTENSIBLE:
        # WAVEFORMATEXTENSIBLE: cbSize, validBits, channelMask, then the sub-format GUID whose
        # first two bytes are the plain format tag.
        if size < 40 or body + 26 > len(data):
            raise BadAudio("WAV extensible fmt chunk is truncated")
        tag = int.from_bytes(data[body + 24 : body + 26], "little")
    return tag, channels, rate, byte_rate, block_align, bits


def _layout(data: bytes) -> _Layout:
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise BadAudio("not a WAV file (no RIFF/WAVE header)")
    riff_size = int.from_bytes(data[4:8], "little")
    to_eof = riff_size in _PLACEHOLDERS
    sizes_exact = riff_size + 8 == len(data)
    fmt: tuple[int, int, int, int, int, int] | None = None
    span: tuple[int, int] | None = None
    for cid, body, size in riff_chunks(data, 12, len(data)):
        if cid == b"fmt " and fmt is None:
            fmt = _parse_fmt(data, body, size)
        elif cid == b"data" and span is None:
            if to_eof or size in _PLACEHOLDERS or body + size > len(data):
                # Placeholder or lying size: the samples run to the end of the bytes.
                span = (body, len(data))
                sizes_exact = False
                break
            span = (body, body + size)
        if fmt is not None and span is not None:
            break
    if fmt is None:
        raise BadAudio("WAV has no fmt chunk")
    if span is None:
        raise BadAudio("WAV has no data chunk")
    tag, channels, rate, byte_rate, block_align, bits = fmt
    if tag == _PCM:
        is_float = False
        if bits not in _PCM_BITS:
            raise BadAudio(f"unsupported WAV PCM sample size: {bits} bits")
    elif tag == _FLOAT:
        is_float = True
        if bits not in _FLOAT_BITS:
            raise BadAudio(f"unsupported WAV float sample size: {bits} bits")
    else:
        raise BadAudio(f"unsupported WAV format tag: {tag:#06x}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise BadAudio(f"unsupported WAV channel count: {channels}")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise BadAudio(f"unsupported WAV sample rate: {rate} Hz")
    frame = channels * bits // 8
    start, end = span
    end = start + (end - start) // frame * frame
    pcm = Pcm(rate=rate, channels=channels, bits=bits, float_=is_float, data=data[start:end])
    return _Layout(pcm, tag, byte_rate, block_align, sizes_exact and end == span[1])


def read_wav(data: bytes) -> Pcm:
    """Parse a RIFF/WAVE file; raise `BadAudio` for anything that is not a readable WAV."""
    return _layout(data).pcm


def wav_bytes(samples: bytes, rate: int, channels: int = 1, bits: int = 16) -> bytes:
    """Integer PCM samples behind the canonical 44-byte header (protocols.md §7.4)."""
    if bits not in _PCM_BITS or not 1 <= channels <= MAX_CHANNELS or rate <= 0:
        raise ValueError(f"cannot write a WAV of {channels} x {bits} bits at {rate} Hz")
    block_align = channels * bits // 8
    if len(samples) % block_align:
        raise ValueError("sample bytes are not a whole number of frames")
    pad = b"\x00" * (len(samples) & 1)  # RIFF chunks are padded to even length
    header = b"".join((
        b"RIFF", struct.pack("<I", 36 + len(samples) + len(pad)), b"WAVE",
        b"fmt ", struct.pack("<I", 16),
        _FMT.pack(_PCM, channels, rate, rate * block_align, block_align, bits),
        b"data", struct.pack("<I", len(samples)),
    ))
    return header + samples + pad


def _is_speech(pcm: Pcm) -> bool:
    return (pcm.rate == SPEECH_RATE and pcm.channels == 1 and pcm.bits == 16
            and not pcm.float_)


def is_speech_wav(data: bytes) -> bool:
    """Exactly 16-bit PCM, mono, 24 kHz, with header sizes that match the bytes."""
    try:
        layout = _layout(data)
    except BadAudio:
        return False
    return (_is_speech(layout.pcm) and layout.tag == _PCM and layout.sizes_exact
            and layout.byte_rate == 2 * SPEECH_RATE and layout.block_align == 2)


def _to_float(pcm: Pcm) -> npt.NDArray[np.float64]:
    """Samples as float64 in [-1, 1), shaped (frames, channels)."""
    import numpy as np

    raw = pcm.data[: pcm.frames * pcm.frame_bytes]
    x: npt.NDArray[np.float64]
    if pcm.float_:
        x = np.frombuffer(raw, dtype="<f4" if pcm.bits == 32 else "<f8").astype(np.float64)
        x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    elif pcm.bits == 8:  # 8-bit WAV is unsigned, centred on 128
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    elif pcm.bits == 24:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = ((v ^ 0x800000) - 0x800000).astype(np.float64) / float(1 << 23)
    else:
        dtype = "<i2" if pcm.bits == 16 else "<i4"
        x = np.frombuffer(raw, dtype=dtype).astype(np.float64) / float(1 << (pcm.bits - 1))
    return x.reshape(-1, pcm.channels)


def _resample(x: npt.NDArray[np.float64], rate: int) -> npt.NDArray[np.float64]:
    import numpy as np

    frames = len(x)
    n_out = round(Fraction(frames * SPEECH_RATE, rate))
    if rate == SPEECH_RATE or frames == 0:
        return x
    if frames == 1:
        return np.full(n_out, x[0])
    # Linear interpolation: output sample i sits at input position i * rate / 24000.
    positions = np.arange(n_out, dtype=np.float64) * (rate / SPEECH_RATE)
    return np.interp(positions, np.arange(frames, dtype=np.float64), x)


def to_speech_wav(data: bytes, *, source: str = "wav", pcm_rate: int = SPEECH_RATE) -> bytes:
    """The gateway's TTS output: 16-bit PCM, mono, 24 kHz behind a canonical header.

    `source` "wav" parses a WAV; "pcm" takes raw s16le mono at `pcm_rate` (OpenAI's
    `response_format: pcm`, openedai-speech's `audio/pcm;rate=22050`). Audio already in the
    target shape keeps its samples byte for byte; only the header is rewritten.
    """
    if source == "pcm":
        if not MIN_RATE <= pcm_rate <= MAX_RATE:
            raise BadAudio(f"unsupported PCM sample rate: {pcm_rate} Hz")
        pcm = Pcm(pcm_rate, 1, 16, False, data[: len(data) // 2 * 2])
    elif source == "wav":
        pcm = read_wav(data)
    else:
        raise ValueError(f"unknown audio source {source!r}")
    if _is_speech(pcm):
        return wav_bytes(pcm.data, SPEECH_RATE)
    import numpy as np

    mono = _to_float(pcm).mean(axis=1)
    out = _resample(mono, pcm.rate)
    ints = np.clip(np.round(out * 32768.0), -32768, 32767).astype("<i2")
    return wav_bytes(ints.tobytes(), SPEECH_RATE)
