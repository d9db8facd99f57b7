#!/usr/bin/env python3
"""Build a tiny, randomly initialised Llama-architecture model + byte-level BPE
tokenizer entirely offline, and save it as a Hugging Face model directory that
vLLM (and llama.cpp's converter) can load.

Usage: python build_tiny_model.py OUT_DIR [--vocab 2048] [--hidden 256] [--layers 2]

No network access: tokenizer is trained on text already on this machine
(/usr/share/common-licenses + a slice of the Python stdlib sources). Deterministic: the same
bytes on every build (seed 0). Run it with the vLLM venv's Python (it needs torch,
transformers and tokenizers): `serve-tiny.sh` does.

Vendored unchanged in substance from the project's shared real-engine recipe
(shared/real-engines/build_tiny_model.py, 2026-11-23); only this note and lint fixes differ.
"""
import argparse
import glob
import json
import os
import sys
import sysconfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus_files():
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    stdlib = sysconfig.get_paths()["stdlib"]
    files += sorted(glob.glob(os.path.join(stdlib, "*.py")))[:200]
    return [f for f in files if os.path.isfile(f)]


# Printable ASCII plus tab/newline. Training only on these bytes (and giving the
# BPE model an unk token) means every token decodes to valid ASCII, so a random
# model can never emit half a UTF-8 sequence. That matters: llama-cpp-python's
# streaming path re-detokenizes every pending token on each step once it sees an
# undecodable byte, which makes a stream crawl and wedge the server (seen here).
ALLOWED = {9, 10, *range(32, 127)}


def ascii_lines(files):
    for f in files:
        with open(f, "rb") as fh:
            for raw in fh:
                yield "".join(chr(b) if b in ALLOWED else " " for b in raw)


def build_tokenizer(vocab_size, ascii_only=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if ascii_only else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if ascii_only:
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
        specials = ["<unk>", *SPECIALS]
    else:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        specials = SPECIALS
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    if ascii_only:
        tok.train_from_iterator(ascii_lines(corpus_files()), trainer)
    else:
        tok.train(corpus_files(), trainer)
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-pos", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full-byte-vocab", action="store_true",
                    help="keep all 256 byte tokens (random output may then contain invalid UTF-8)")
    a = ap.parse_args()

    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(a.out, exist_ok=True)
    raw = build_tokenizer(a.vocab, ascii_only=not a.full_byte_vocab)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=a.max_pos,
        **({} if a.full_byte_vocab else {"unk_token": "<unk>"}),
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(a.out)
    # transformers 5 writes tokenizer_class "TokenizersBackend", which older
    # loaders (transformers 4.x, llama.cpp's converter) do not know; the
    # generic fast-tokenizer class name loads in both.
    tc_path = os.path.join(a.out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.setdefault("chat_template", CHAT_TEMPLATE)
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2)

    vocab = len(tok)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    bos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(a.seed)
    cfg = llama_config(a, vocab, bos_id, eos_id)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = bos_id
    model.save_pretrained(a.out, safe_serialization=True)

    # sanity: chat template renders and round-trips
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    print(json.dumps({
        "out": a.out,
        "vocab": vocab,
        "eos_id": eos_id,
        "params": sum(p.numel() for p in model.parameters()),
        "prompt_ids": list(ids)[:32],
        "files": sorted(os.listdir(a.out)),
    }))


def llama_config(a, vocab, bos_id, eos_id):
    """The tiny Llama's shape (also build_tiny_embedder.py's): bf16, pad = BOS."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 2,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.max_pos,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=bos_id,
        torch_dtype="bfloat16",
    )


if __name__ == "__main__":
    sys.exit(main())
