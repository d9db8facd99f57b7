"""Speech for the media simulators: a voiced waveform, its text watermark, transcripts.

Pure (numpy, no I/O). The TTS simulator speaks text as a buzz whose duration follows the
text (60 ms a character over `speed`), and hides the text in the samples' least significant
bits, as CSM-1B watermarks its own output. The whisper simulator reads that watermark back,
so a gateway's TTS -> ASR round trip returns exactly the text it started from; audio without
the mark gets a deterministic pseudo-transcript of about 2.5 words a second.

Timing: a character's sound occupies an equal share of the audio, so a word's start and end
are its character offsets scaled to the duration; transcripts use the same rule.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from proxy.media.audio import NotAudio, probe, sniff
from proxy.media.wav import SPEECH_RATE, BadAudio, read_wav

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
                 "shimmer", "verse")
CSM_PRESETS = ("alice", "avery", "brock", "chloe", "ella", "emma", "grace", "karen", "kevin",
               "lucas", "matt", "william")
DEFAULT_VOICES = OPENAI_VOICES + CSM_PRESETS
SECONDS_PER_CHAR = 0.06
MIN_SECONDS = 0.3
WORDS_PER_SECOND = 2.5  # pseudo-transcripts: a calm speaking rate
MAX_CHUNK_S = 30.0  # Whisper hears 30 s windows; a segment never spans two
UNKNOWN_BITRATE = 128_000  # a compressed file without a stated duration: assume 128 kbps
MAGIC = b"CSMw"  # watermark frame: MAGIC, length (2 bytes, big-endian), UTF-8 text, CRC-32
_FRAME_EXTRA = len(MAGIC) + 2 + 4

Int16s = npt.NDArray[np.int16]


# --- synthesis ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Speaker:
    pitch_hz: float
    harmonics: tuple[float, ...]  # relative amplitudes of the first partials: the timbre


def speaker_for(key: bytes) -> Speaker:
    """A speaker seeded by `key`: pitch 85-255 Hz (adult speech) and a timbre."""
    digest = hashlib.sha256(key).digest()
    pitch = 85 + int.from_bytes(digest[:2], "big") % 1700 / 10
    harmonics = tuple((0.25 + digest[2 + k] / 340) / (k + 1) for k in range(4))
    return Speaker(pitch, harmonics)


def voice_speaker(voice: str) -> Speaker:
    return speaker_for(b"voice:" + voice.encode())


def sample_speaker(samples: bytes) -> Speaker:
    """Voice cloning, simulated: a reference clip picks the speaker, so clips differ."""
    return speaker_for(b"sample:" + samples)


def speech_seconds(text: str, speed: float) -> float:
    return max(MIN_SECONDS, SECONDS_PER_CHAR * len(text) / speed)


def synthesize(text: str, speaker: Speaker, speed: float, rate: int = SPEECH_RATE) -> bytes:
    """s16le mono samples: `speaker`'s voice over each word, silence at spaces, watermarked."""
    n = max(1, round(speech_seconds(text, speed) * rate))
    length = max(len(text), 1)
    pos = np.arange(n, dtype=np.float64) * (length / n)  # fractional character position
    char = np.minimum(pos.astype(np.int64), length - 1)
    start = np.zeros(length)
    end = np.ones(length)
    voiced = np.zeros(length, dtype=bool)
    for word in re.finditer(r"\S+", text):
        start[word.start() : word.end()] = word.start()
        end[word.start() : word.end()] = word.end()
        voiced[word.start() : word.end()] = True
    # Each word swells and fades (a syllable-ish envelope); spaces are silent.
    through = np.clip((pos - start[char]) / (end[char] - start[char]), 0.0, 1.0)
    envelope = np.where(voiced[char], np.sqrt(np.sin(np.pi * through)), 0.0)
    t = np.arange(n, dtype=np.float64) / rate
    f0 = speaker.pitch_hz * (1 + 0.04 * np.sin(2 * np.pi * 0.7 * t))  # a little intonation
    phase = 2 * np.pi * np.cumsum(f0) / rate
    wave = np.zeros(n)
    for k, weight in enumerate(speaker.harmonics):
        wave += weight * np.sin((k + 1) * phase)
    wave /= sum(speaker.harmonics)
    samples = np.round(wave * envelope * 0.4 * 32767).astype(np.int16)
    return embed_text(samples, text).astype("<i2").tobytes()


# --- watermark ----------------------------------------------------------------------------


def _frame(text: str, room_bytes: int) -> bytes:
    raw = text.encode()[: max(room_bytes - _FRAME_EXTRA, 0)]
    raw = raw.decode("utf-8", "ignore").encode()  # never cut a character in half
    head = MAGIC + len(raw).to_bytes(2, "big") + raw
    return head + zlib.crc32(head).to_bytes(4, "big")


def embed_text(samples: Int16s, text: str) -> Int16s:
    """Write the frame into the samples' least significant bits, one bit per sample from
    sample 0 (most significant bit of each byte first); the text is cut to what fits."""
    if len(samples) < 8 * _FRAME_EXTRA:
        return samples
    bits = np.unpackbits(np.frombuffer(_frame(text, min(len(samples) // 8, 65535)), np.uint8))
    marked = samples.copy()
    marked[: len(bits)] = (marked[: len(bits)] & ~1) | bits.astype(np.int16)
    return marked


def read_text(data: bytes) -> str | None:
    """The watermarked text of s16le samples, or None when there is no intact frame."""
    samples = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2")
    if len(samples) < 8 * _FRAME_EXTRA:
        return None
    lsb = (samples & 1).astype(np.uint8)
    head = np.packbits(lsb[:48]).tobytes()
    if head[:4] != MAGIC:
        return None
    total = 6 + int.from_bytes(head[4:6], "big") + 4
    if total * 8 > len(samples):
        return None
    frame = np.packbits(lsb[: total * 8]).tobytes()
    if zlib.crc32(frame[:-4]).to_bytes(4, "big") != frame[-4:]:
        return None
    try:
        return frame[6:-4].decode()
    except UnicodeDecodeError:
        return None


# --- hearing ------------------------------------------------------------------------------


class Undecodable(ValueError):
    """Audio the server cannot decode; `broken_wav`: a RIFF header with nothing usable."""

    def __init__(self, message: str, broken_wav: bool) -> None:
        super().__init__(message)
        self.broken_wav = broken_wav


@dataclass(frozen=True, slots=True)
class Heard:
    format: str
    duration_s: float
    rate: int | None
    marked_text: str | None  # the TTS watermark, when the audio carries one


def hear(data: bytes) -> Heard:
    """What a decoder learns: WAV is read sample by sample (and may carry the watermark);
    other formats are measured from their container, or from their size at 128 kbps when the
    container does not say (a real decoder would count the frames)."""
    kind = sniff(data)
    if kind == "wav":
        try:
            pcm = read_wav(data)
        except BadAudio as exc:
            raise Undecodable(str(exc), broken_wav=True) from None
        if pcm.frames == 0:
            raise Undecodable("WAV has no samples", broken_wav=True)
        marked = read_text(pcm.data) if pcm.bits == 16 and not pcm.float_ else None
        return Heard("wav", pcm.duration_s, pcm.rate, marked)
    try:
        info = probe(data)
    except NotAudio as exc:
        raise Undecodable(str(exc), broken_wav=False) from None
    seconds = info.duration_s
    if seconds is None:
        seconds = len(data) * 8 / UNKNOWN_BITRATE
    return Heard(info.format, seconds, info.sample_rate, None)


# --- transcripts --------------------------------------------------------------------------

def _split(text: str) -> tuple[str, ...]:
    return tuple(text.split())


WORDS = _split("""the of and to in is that it was for on are with as they be at one have this
from or had by word but what some we can out other were all there when up use your how said
each she which do their time if will way about many then them write would like so these her
long make thing see him two has look more day could go come did number sound most people my
over know water than call first who may down side been now find new work part take get place
made live where after back little only round man year came show every good me give our under
name very through just form sentence great think say help low line turn cause much mean
before move right boy old too same tell does set three want air well also play small end put
home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try again animal point mother world near build
self earth father river music garden window morning quiet bright""")


def pseudo_transcript(audio: bytes, seconds: float) -> str:
    """About 2.5 words a second of plain English, chosen by the audio's hash."""
    rng = random.Random(hashlib.sha256(audio).digest())
    left = max(1, round(WORDS_PER_SECOND * seconds))
    sentences = []
    while left > 0:
        size = min(left, rng.randint(4, 12))
        words = [rng.choice(WORDS) for _ in range(size)]
        sentences.append(" ".join(words).capitalize() + ".")
        left -= size
    return " ".join(sentences)


def transcript(audio: bytes, heard: Heard) -> tuple[str, float]:
    """What a server hears in `audio`: its watermarked text, or else a pseudo-transcript; and
    the duration it reports (to the millisecond)."""
    duration = round(heard.duration_s, 3)
    text = heard.marked_text
    return (pseudo_transcript(audio, duration) if text is None else text), duration


@dataclass(frozen=True, slots=True)
class Word:
    text: str  # as written, punctuation included
    start: float
    end: float
    token: int  # a stable stand-in for a Whisper text token id


@dataclass(frozen=True, slots=True)
class Segment:
    chunk: int  # the 30 s window it starts in
    start: float
    end: float
    text: str
    words: tuple[Word, ...]


def _at(offset: int, length: int, duration: float) -> float:
    return min(round(duration * offset / length, 2), duration)


def segments(text: str, duration: float) -> list[Segment]:
    """The text in segments ending at sentence ends and at 30 s window edges; times spread
    over [0, duration] by character offset (to 0.01 s), monotonic; the segments tile
    [0, duration] (pass the duration as it will be reported, already rounded)."""
    length = max(len(text), 1)
    groups: list[list[tuple[int, int, int]]] = []  # (start offset, end offset, chunk)
    sentence_over = True
    for match in re.finditer(r"\S+", text):
        chunk = int(duration * match.start() / length // MAX_CHUNK_S)
        if sentence_over or groups[-1][-1][2] != chunk:
            groups.append([])
        groups[-1].append((match.start(), match.end(), chunk))
        sentence_over = match.group()[-1] in ".!?"
    out: list[Segment] = []
    for i, group in enumerate(groups):
        words = tuple(
            Word(text[a:b], _at(a, length, duration), _at(b, length, duration),
                 zlib.crc32(text[a:b].encode()) % 50000 + 220)
            for a, b, _chunk in group
        )
        start = out[-1].end if out else 0.0
        end = duration if i == len(groups) - 1 else words[-1].end
        text_span = text[group[0][0] : group[-1][1]]
        out.append(Segment(group[0][2], start, end, text_span, words))
    return out


def avg_logprob(text: str) -> float:
    """A plausible, stable average log-probability (Whisper's are about -0.1 to -0.6)."""
    return -0.1 - zlib.crc32(text.encode()) % 5000 / 10000


def compression_ratio(text: str) -> float:
    """As Whisper computes it: UTF-8 length over zlib-compressed length."""
    raw = text.encode()
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def usage_seconds(duration: float) -> int:
    """vLLM's `usage.seconds`: whole seconds, rounded up (0.1 s bills 1)."""
    return max(1, math.ceil(round(duration, 6)))


# --- languages ----------------------------------------------------------------------------


def _pairs(table: str) -> dict[str, str]:
    return {code: name.replace("_", " ") for code, _, name in
            (pair.partition(":") for pair in table.split())}


# Whisper's tokenizer languages (code: name), in its order.
LANGUAGES = _pairs("""en:english zh:chinese de:german es:spanish
ru:russian ko:korean fr:french ja:japanese pt:portuguese tr:turkish pl:polish ca:catalan
nl:dutch ar:arabic sv:swedish it:italian id:indonesian hi:hindi fi:finnish vi:vietnamese
he:hebrew uk:ukrainian el:greek ms:malay cs:czech ro:romanian da:danish hu:hungarian ta:tamil
no:norwegian th:thai ur:urdu hr:croatian bg:bulgarian lt:lithuanian la:latin mi:maori
ml:malayalam cy:welsh sk:slovak te:telugu fa:persian lv:latvian bn:bengali sr:serbian
az:azerbaijani sl:slovenian kn:kannada et:estonian mk:macedonian br:breton eu:basque
is:icelandic hy:armenian ne:nepali mn:mongolian bs:bosnian kk:kazakh sq:albanian sw:swahili
gl:galician mr:marathi pa:punjabi si:sinhala km:khmer sn:shona yo:yoruba so:somali
af:afrikaans oc:occitan ka:georgian be:belarusian tg:tajik sd:sindhi gu:gujarati am:amharic
yi:yiddish lo:lao uz:uzbek fo:faroese ht:haitian_creole ps:pashto tk:turkmen nn:nynorsk
mt:maltese sa:sanskrit lb:luxembourgish my:myanmar bo:tibetan tl:tagalog mg:malagasy
as:assamese tt:tatar haw:hawaiian ln:lingala ha:hausa ba:bashkir jw:javanese su:sundanese
yue:cantonese""")
# The codes vLLM's Whisper lists as supported, in its order (its 400 names them all); the
# other Whisper codes pass with a server-side warning.
VLLM_LANGUAGES = _split("af ar hy az be bs bg ca zh hr cs da nl en et fi fr gl de el he hi hu "
                        "is id it ja kn kk ko lv lt mk ms mr mi ne no fa pl pt ro ru sr sk sl "
                        "es sw sv tl ta th tr uk ur vi cy")
