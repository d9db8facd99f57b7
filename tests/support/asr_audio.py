"""Test audio for the Whisper replica: WAV tones (numpy and the stdlib), and FLAC, MP3, OGG (Opus)
and M4A (AAC) encoded with PyAV from the same samples (no TTS, sox or ffmpeg on the box)."""

from __future__ import annotations

import io
import wave

import numpy as np

RATE = 16000
# (container, codec, codec's sample rate): what PyAV writes for each format.
ENCODINGS = {"flac": ("flac", "flac", RATE), "mp3": ("mp3", "libmp3lame", RATE),
             "ogg": ("ogg", "libopus", 48000), "m4a": ("ipod", "aac", RATE),
             "webm": ("webm", "libopus", 48000)}


def samples(seconds: float, rate: int = RATE, freq: float = 440.0) -> np.ndarray:
    """A tone with a little noise (seeded), float32 in [-1, 1]."""
    t = np.arange(round(seconds * rate)) / rate
    noise = np.random.default_rng(0).normal(0.0, 0.025, t.size)
    return (0.25 * np.sin(2 * np.pi * freq * t) + noise).astype(np.float32)


def wav(seconds: float, rate: int = RATE, channels: int = 1, freq: float = 440.0) -> bytes:
    """16-bit PCM WAV of a tone, the same on every channel."""
    pcm = (samples(seconds, rate, freq) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm[:, None], channels, axis=1).tobytes())
    return out.getvalue()


def wav_of_size(size: int, rate: int = 44100, channels: int = 2) -> bytes:
    """A WAV of exactly `size` bytes (44-byte header, then a tone): 25 MB of 44.1 kHz stereo
    is about 149 s, within both the gateway's and vLLM's 600 s."""
    frames = (size - 44) // (2 * channels)
    assert 44 + frames * 2 * channels == size, "size must fit whole frames"
    return wav(frames / rate, rate, channels)


def silence(data_bytes: int, rate: int = RATE) -> bytes:
    """A 16-bit mono WAV of zeros with `data_bytes` of samples."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(data_bytes))
    return out.getvalue()


def encoded(fmt: str, seconds: float = 3.0, freq: float = 440.0) -> bytes:
    """The 16 kHz mono tone, encoded with PyAV."""
    import av  # the test extras' (PyAV bundles its own FFmpeg)

    container, codec, rate = ENCODINGS[fmt]
    frame = av.AudioFrame.from_ndarray(samples(seconds, RATE, freq)[None, :], format="flt",
                                       layout="mono")
    frame.sample_rate = RATE
    out = io.BytesIO()
    with av.open(out, "w", format=container) as file:
        stream = file.add_stream(codec, rate=rate)
        stream.layout = "mono"
        resampler = av.AudioResampler(format=stream.format, layout="mono", rate=rate)
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            file.mux(stream.encode(piece))
        file.mux(stream.encode(None))
    return out.getvalue()
