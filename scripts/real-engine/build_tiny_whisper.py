#!/usr/bin/env python3
"""Build a tiny Whisper (WhisperForConditionalGeneration) model directory offline,
for vLLM's /v1/audio/transcriptions endpoint.

Usage: python build_tiny_whisper.py OUT_DIR [--d-model 64] [--layers 2] [--heads 2]
                                       [--bpe-vocab 1000] [--seg1 8] [--seg2 6]
                                       [--ts1 1.00] [--ts2 2.00] [--dtype bfloat16]

What is in OUT_DIR: config.json, generation_config.json, model.safetensors,
tokenizer.json + tokenizer_config.json (class WhisperTokenizer),
preprocessor_config.json / processor_config.json (WhisperFeatureExtractor,
WhisperProcessor: 80 mel bins, 16 kHz, 30 s chunks, hop 160).

Token layout copies multilingual Whisper: BPE ids first, then <|endoftext|>,
<|startoftranscript|>, the 99 language tokens in Whisper's order, <|translate|>,
<|transcribe|>, <|startoflm|>, <|startofprev|>, <|nocaptions|>, <|notimestamps|>,
then 1501 timestamp tokens <|0.00|> .. <|30.00|> (vLLM's verbose_json parser
treats every id >= <|0.00|> as a timestamp, so they must be last).
Deviation: the timestamp tokens are marked special, so vLLM's
skip_special_tokens strips them from `text` (real Whisper never emits them
with <|notimestamps|>; this random model emits them always).

The weights are random (seed 0) except a few "steering" channels of the
decoder's token/position embeddings, so that greedy decoding gives a clean,
realistic token sequence instead of 448 tokens of junk:
    <seg1 text tokens> <|ts1|><|ts1|> <seg2 text tokens> <|ts2|> <|endoftext|>
and language detection (decoder prompt <|startoftranscript|> only) picks <|en|>.
With the default vLLM prompt (4 tokens) that is 8 + 2 + 6 + 1 (+ EOS) tokens,
two segments in verbose_json ([0, ts1] and [ts1, ts2]). The text tokens themselves
are random ASCII BPE pieces, chosen by tiny audio-dependent differences.
No network access: the BPE is trained on text already on this machine. Deterministic
(seed 0). Run it with the vllm-audio venv's Python (torch, transformers, tokenizers):
`serve-whisper.sh` does.

Vendored unchanged in substance from the project's shared real-engine recipe
(shared/real-engines/whisper-build-tiny-model.py, 2026-11-23); only this note and lint fixes
differ.
"""
import argparse
import glob
import json
import os
import sys
import sysconfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Printable ASCII plus tab/newline: every BPE token decodes to clean ASCII, so a
# random model can never emit half a UTF-8 sequence. Non-ASCII input characters
# (e.g. in `prompt`) are dropped by the tokenizer (no unk token).
ALLOWED = {9, 10, *range(32, 127)}


def corpus_files():
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    stdlib = sysconfig.get_paths()["stdlib"]
    files += sorted(glob.glob(os.path.join(stdlib, "*.py")))[:200]
    return [f for f in files if os.path.isfile(f)]


def ascii_lines(files):
    for f in files:
        with open(f, "rb") as fh:
            for raw in fh:
                yield "".join(chr(b) if b in ALLOWED else " " for b in raw)


def train_bpe(vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # GPT-2's byte->unicode map (what the ByteLevel pre-tokenizer uses).
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    b2u = dict(zip(bs, map(chr, cs), strict=True))
    alphabet = [b2u[b] for b in sorted(ALLOWED)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(ascii_lines(corpus_files()), trainer)
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bpe-vocab", type=int, default=1000)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2, help="encoder and decoder layers each")
    ap.add_argument("--heads", type=int, default=2,
                    help="head_dim = d_model/heads must be 32/64/80/96/...")
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--seg1", type=int, default=8, help="text tokens in segment 1")
    ap.add_argument("--seg2", type=int, default=6, help="text tokens in segment 2")
    ap.add_argument("--ts1", type=float, default=1.00)
    ap.add_argument("--ts2", type=float, default=2.00)
    ap.add_argument("--no-steer", action="store_true",
                    help="plain random weights (greedy output then runs to max length)")
    ap.add_argument("--no-audio-gain", action="store_true",
                    help="skip the encoder/cross-attention changes that make the text depend "
                         "on the audio")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from tokenizers import AddedToken
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    os.makedirs(a.out, exist_ok=True)

    # ---- tokenizer -------------------------------------------------------
    raw = train_bpe(a.bpe_vocab)
    model_json = json.loads(raw.to_str())["model"]
    vocab = dict(model_json["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in model_json["merges"]]
    n_bpe = len(vocab)
    # <|endoftext|> sits right after the BPE vocabulary, as in Whisper (50257)
    vocab["<|endoftext|>"] = n_bpe
    tok = WhisperTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=448,
    )
    langs = list(LANGUAGES.keys())[:99]  # multilingual v1/v2 set (v3 adds yue)
    specials = (
        ["<|startoftranscript|>"]
        + [f"<|{lang}|>" for lang in langs]
        + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
           "<|nocaptions|>", "<|notimestamps|>"]
    )
    tok.add_tokens([AddedToken(t, lstrip=False, rstrip=False, normalized=False, special=True)
                    for t in specials], special_tokens=True)
    timestamps = [AddedToken(f"<|{i * 0.02:.2f}|>", lstrip=False, rstrip=False,
                             normalized=False, special=True)
                  for i in range(1501)]
    tok.add_tokens(timestamps, special_tokens=True)

    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
            "<|startofprev|>", "<|notimestamps|>", "<|0.00|>", "<|30.00|>"]}
    # layout checks
    assert ids["<|endoftext|>"] == n_bpe, ids
    assert ids["<|startoftranscript|>"] == n_bpe + 1, ids
    assert ids["<|en|>"] == n_bpe + 2, ids
    assert ids["<|notimestamps|>"] + 1 == ids["<|0.00|>"], ids
    assert ids["<|30.00|>"] == ids["<|0.00|>"] + 1500, ids
    vocab_size = len(tok)
    assert vocab_size == ids["<|30.00|>"] + 1, (vocab_size, ids)

    fe = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160,
                                 chunk_length=30, n_fft=400, padding_value=0.0,
                                 return_attention_mask=False)
    proc = WhisperProcessor(feature_extractor=fe, tokenizer=tok)
    proc.save_pretrained(a.out)
    # belt and braces: the class name older/newer loaders know
    tc_path = os.path.join(a.out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "WhisperTokenizer"
    tc["processor_class"] = "WhisperProcessor"
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2)

    # ---- model -----------------------------------------------------------
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    torch.manual_seed(a.seed)
    cfg = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=80,
        encoder_layers=a.layers,
        encoder_attention_heads=a.heads,
        decoder_layers=a.layers,
        decoder_attention_heads=a.heads,
        encoder_ffn_dim=a.ffn,
        decoder_ffn_dim=a.ffn,
        d_model=a.d_model,
        max_source_positions=1500,
        max_target_positions=448,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=[tok.convert_tokens_to_ids("\u0120") if "\u0120" in vocab
                               else eot, eot],
        suppress_tokens=[],
        tie_word_embeddings=True,
        torch_dtype=a.dtype,
    )
    model = WhisperForConditionalGeneration(cfg)
    model.eval()

    if not a.no_steer:
        steer(model, tok, ids, n_bpe, a)
    if not a.no_audio_gain:
        audio_gain(model, a)

    dtype = getattr(torch, a.dtype)
    model = model.to(dtype)

    gc = GenerationConfig(
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=sot,
        max_length=448,
        begin_suppress_tokens=cfg.begin_suppress_tokens,
        suppress_tokens=[],
        is_multilingual=True,
        lang_to_id={f"<|{lang}|>": tok.convert_tokens_to_ids(f"<|{lang}|>") for lang in langs},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        forced_decoder_ids=None,
        return_timestamps=False,
        max_initial_timestamp_index=50,
    )
    model.generation_config = gc
    model.save_pretrained(a.out, safe_serialization=True)

    # ---- sanity: HF decoding on a few synthetic clips --------------------
    import numpy as np
    t = np.arange(48000) / 16000
    clips = {
        "tone440_3s": (0.25 * np.sin(2 * np.pi * 440 * t)).astype(np.float32),
        "tone1000_2s": (0.25 * np.sin(2 * np.pi * 1000 * t[:32000])).astype(np.float32),
        "chirp_3s": (0.25 * np.sin(2 * np.pi * (200 + 400 * t) * t)).astype(np.float32),
        "silence_1s": np.zeros(16000, np.float32),
    }
    prompt = torch.tensor([[sot, ids["<|en|>"], ids["<|transcribe|>"], ids["<|notimestamps|>"]]])
    lang_ids = [tok.convert_tokens_to_ids(f"<|{lang}|>") for lang in langs]

    def decode(enc, temperature=0.0, gen=None):
        seq = prompt
        for _ in range(40):
            logits = model(encoder_outputs=enc, decoder_input_ids=seq).logits[0, -1].float()
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1,
                                            generator=gen))
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
            if nxt == eot:
                break
        return seq[0, 4:].tolist()

    greedy, structure_ok, det = {}, 0, {}
    g = torch.Generator().manual_seed(0)
    ts0 = ids["<|0.00|>"]
    with torch.no_grad():
        for name, audio in clips.items():
            feats = fe(audio, sampling_rate=16000, return_tensors="pt").input_features.to(dtype)
            enc = model.model.encoder(feats)
            out_ids = decode(enc)
            greedy[name] = tok.decode(out_ids, skip_special_tokens=True)
            lang_logits = model(encoder_outputs=enc,
                                decoder_input_ids=torch.tensor([[sot]])).logits[0, -1].float()
            det[name] = langs[int(lang_logits[lang_ids].argmax())]
            if name == "tone440_3s":
                greedy_ids = out_ids
                for _ in range(10):  # temperature 1: does the segment/EOS structure survive?
                    o = decode(enc, 1.0, g)
                    structure_ok += int(len(o) == len(out_ids) and o[-1] == eot
                                        and sum(1 for x in o if x >= ts0) == 3)
    out_ids = greedy_ids
    print(json.dumps({
        "out": a.out,
        "vocab_size": vocab_size,
        "n_bpe": n_bpe,
        "ids": ids,
        "params": sum(p.numel() for p in model.parameters()),
        "greedy_ids_tone440_3s": out_ids,
        "greedy_with_ts_tone440_3s": tok.decode(out_ids, skip_special_tokens=False),
        "greedy_text": greedy,
        "temperature1_structure_ok_of_10": structure_ok,
        "detected_language": det,
        "files": sorted(os.listdir(a.out)),
    }, indent=1))


def audio_gain(model, a, c=10.0, s=3.0, beta=8.0, K=30.0):
    """With plain random init the encoder output is dominated by its sinusoidal
    position embedding and the decoder's cross-attention averages over 1500
    frames, 90 % of them padding for a 3 s clip: every audio gives the same text.
    So: (1) scale the conv stem up (audio features ~ as large as positions);
    (2) make encoder channel ce = d/2-1 (whose sinusoid is ~0) a "spectral
    non-flatness" detector: 8 zero-sum mel filters and their negatives through
    GELU, summed by conv2 -> ~0 on padding (flat log-mel), > 0 on audio frames;
    (3) in every decoder cross-attention head, query dim 0 = constant beta (from
    the layer norm bias of channel 5) and key dim 0 = enc[ce], so attention
    concentrates on audio frames; (4) scale the cross-attention output by K,
    leaving the 5 steering channels untouched. Tones of different pitch/length
    then give different (still deterministic) greedy text; silence and white
    noise give the same "default" text."""
    import torch

    enc = model.model.encoder
    d = enc.conv1.weight.shape[0]
    ce = d // 2 - 1
    gen = torch.Generator().manual_seed(a.seed + 123)
    with torch.no_grad():
        enc.conv1.weight *= c
        enc.conv2.weight *= c
        for i in range(8):
            w = torch.randn(enc.conv1.weight.shape[1], generator=gen)
            w -= w.mean()
            w /= w.norm()
            enc.conv1.weight[i] = 0
            enc.conv1.weight[i, :, 1] = s * w
            enc.conv1.bias[i] = 0
            enc.conv1.weight[i + 8] = 0
            enc.conv1.weight[i + 8, :, 1] = -s * w
            enc.conv1.bias[i + 8] = 0
        enc.conv2.weight[ce] = 0
        enc.conv2.weight[ce, 0:16, 1] = 1.0
        enc.conv2.bias[ce] = 0
        n_heads = model.config.decoder_attention_heads
        hd = d // n_heads
        for layer in model.model.decoder.layers:
            ea = layer.encoder_attn
            layer.encoder_attn_layer_norm.weight[5] = 0
            layer.encoder_attn_layer_norm.bias[5] = 1.0
            for h in range(n_heads):
                r = h * hd
                ea.q_proj.weight[r] = 0
                ea.q_proj.weight[r, 5] = beta
                ea.q_proj.bias[r] = 0
                ea.k_proj.weight[r] = 0
                ea.k_proj.weight[r, ce] = 1.0
            ea.out_proj.weight *= K
            ea.out_proj.weight[0:5, :] = 0
            ea.out_proj.bias[0:5] = 0


def steer(model, tok, ids, n_bpe, a):
    """Overwrite 5 channels of the decoder token/position embeddings (tied to the
    LM head) so that the final layer norm sees one dominant channel per position:
      ch0 -> <|endoftext|>, ch1 -> <|ts1|>, ch2 -> any BPE text token,
      ch3 -> <|en|> (language detection at position 0), ch4 -> <|ts2|>.
    pos_emb[p] = target(p) - class_channels(input token expected at p), so the
    input token's own channels are cancelled."""
    import torch

    G = 8.0      # strength of a target channel
    A_TXT = 3.0  # text tokens' value in ch2 (it is also their input embedding; cancelled below)
    NOISE = 1.0  # std of the other position channels: makes the greedy text vary by position
    E = model.model.decoder.embed_tokens.weight  # tied with proj_out
    P = model.model.decoder.embed_positions.weight
    n_pos = P.shape[0]
    eot = ids["<|endoftext|>"]
    ts0 = ids["<|0.00|>"]
    ts1 = ts0 + round(a.ts1 / 0.02)
    ts2 = ts0 + round(a.ts2 / 0.02)
    en = ids["<|en|>"]
    with torch.no_grad():
        E[:, 0:5] = 0.0
        E[:n_bpe, 2] = A_TXT
        E[eot, 0] = G
        E[ts1, 1] = G
        E[ts2, 4] = G
        E[en, 3] = G

        def cls(kind):  # channel vector of a token class's input embedding
            v = torch.zeros(5)
            if kind == "text":
                v[2] = A_TXT
            elif kind == "ts1":
                v[1] = G
            elif kind == "ts2":
                v[4] = G
            elif kind == "eot":
                v[0] = G
            return v

        # output schedule by absolute decoder position (the default prompt
        # <|startoftranscript|><|lang|><|task|><|notimestamps|> fills 0..3)
        sched = {0: "lang", 1: None, 2: None}
        p = 3
        for kind in ["text"] * a.seg1 + ["ts1", "ts1"] + ["text"] * a.seg2 + ["ts2"]:
            sched[p] = kind
            p += 1
        g = torch.Generator().manual_seed(a.seed + 1)
        P[:, 5:] = torch.randn(P[:, 5:].shape, generator=g) * NOISE
        P[:, 0:5] = 0.0
        prev_out = None  # class of the token generated at p-1 (= input at p)
        for pos in range(n_pos):
            target = sched.get(pos, "eot") if pos >= 3 or pos in sched else None
            tv = torch.zeros(5)
            if target == "lang":
                tv[3] = G
            elif target == "text":
                tv[2] = G
            elif target == "ts1":
                tv[1] = G
            elif target == "ts2":
                tv[4] = G
            elif target == "eot":
                tv[0] = G
            inp = prev_out if pos >= 4 else None
            P[pos, 0:5] = tv - (cls(inp) if inp else torch.zeros(5))
            prev_out = target if pos >= 3 else None


if __name__ == "__main__":
    sys.exit(main())
