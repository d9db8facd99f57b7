#!/usr/bin/env python3
"""Build a tiny, randomly initialised text-embedding model directory offline, for vLLM's
/v1/embeddings endpoint (and /pooling, /tokenize).

Usage: python build_tiny_embedder.py OUT_DIR [--vocab 2048] [--hidden 256] [--layers 2]
                                          [--matryoshka 32,64,128,256]

It is laid out like a real decoder-based embedder (Qwen3-Embedding, e5-mistral): a bare
`LlamaModel` (no LM head; architectures ["LlamaModel"], which vLLM serves as an embedding
model), plus the Sentence Transformers files vLLM reads for its pooler:
modules.json (Transformer -> Pooling -> Normalize) and 1_Pooling/config.json
(`pooling_mode_lasttoken`), so vLLM resolves `--runner auto` to pooling/embed by itself, pools
the last token and L2-normalises. Like Qwen3-Embedding, the tokenizer appends `<|endoftext|>`
to every text it encodes (its post-processor), so the last token is always that one; a
request of raw token ids gets nothing appended. config.json carries `is_matryoshka` and
`matryoshka_dimensions`, so requests with `dimensions` (one of those values) are served.
The embedding size is the hidden size (256 by default).

The tokenizer is build_tiny_model.py's ASCII-only byte-level BPE (non-ASCII -> <unk>), trained
the same way on text already on this machine. No network access. Deterministic: the same bytes
on every build (seed 0). Run it with the vLLM venv's Python (torch, transformers, tokenizers):
`serve-embed.sh` does.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under `python -I`
sys.dont_write_bytecode = True  # no __pycache__ in the clone

from build_tiny_model import CHAT_TEMPLATE, build_tokenizer, llama_config  # noqa: E402

EOS = "<|endoftext|>"  # appended to every encoded text; the pooled (last) token

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling",
     "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize",
     "type": "sentence_transformers.models.Normalize"},
]


def pooling_config(dim):
    return {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    }


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-pos", type=int, default=2048)
    ap.add_argument("--matryoshka", default="32,64,128,256",
                    help="comma-separated dimensions a request may ask for ('' = none)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from tokenizers import processors
    from transformers import LlamaModel, PreTrainedTokenizerFast

    dims = [int(d) for d in a.matryoshka.split(",") if d.strip()]
    if any(not 1 <= d <= a.hidden for d in dims):
        ap.error(f"--matryoshka dimensions must be in [1, {a.hidden}]")

    os.makedirs(a.out, exist_ok=True)
    raw = build_tokenizer(a.vocab, ascii_only=True)
    eos_id = raw.token_to_id(EOS)
    raw.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {EOS}:0", pair=f"$A:0 {EOS}:0 $B:1 {EOS}:1",
        special_tokens=[(EOS, eos_id)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token="<unk>",
        model_max_length=a.max_pos,
    )
    tok.chat_template = CHAT_TEMPLATE  # for /v1/embeddings' `messages` form
    tok.save_pretrained(a.out)
    # transformers 5 writes tokenizer_class "TokenizersBackend"; the generic name loads anywhere.
    tc_path = os.path.join(a.out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.setdefault("chat_template", CHAT_TEMPLATE)
    write_json(tc_path, tc)

    vocab = len(tok)
    torch.manual_seed(a.seed)
    cfg = llama_config(a, vocab, eos_id, eos_id)
    model = LlamaModel(cfg)
    with torch.no_grad():
        # nn.Embedding zeroes its padding_idx row (pad = <|endoftext|>), but that is the token
        # every text ends with and the one pooled: a zero row would make "" embed to a zero
        # vector. Give it a random row like the others (a trained model has one).
        emb = model.embed_tokens.weight
        emb[eos_id] = torch.randn(emb.shape[1]) * cfg.initializer_range
    model = model.to(torch.bfloat16)
    model.config.architectures = ["LlamaModel"]
    model.save_pretrained(a.out, safe_serialization=True)
    cfg_path = os.path.join(a.out, "config.json")
    with open(cfg_path) as f:
        c = json.load(f)
    c["architectures"] = ["LlamaModel"]
    if dims:
        c["is_matryoshka"] = True
        c["matryoshka_dimensions"] = dims
    write_json(cfg_path, c)

    write_json(os.path.join(a.out, "modules.json"), MODULES)
    write_json(os.path.join(a.out, "1_Pooling", "config.json"), pooling_config(a.hidden))
    write_json(os.path.join(a.out, "config_sentence_transformers.json"), {
        "prompts": {"query": "", "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    })
    write_json(os.path.join(a.out, "sentence_bert_config.json"),
               {"max_seq_length": a.max_pos, "do_lower_case": False})

    # sanity: the reference embedding (HF, last token, L2 norm) of one text
    ids = tok("hello world")["input_ids"]
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    v = torch.nn.functional.normalize(h, dim=-1)
    print(json.dumps({
        "out": a.out,
        "vocab": vocab,
        "eos_id": eos_id,
        "params": sum(p.numel() for p in model.parameters()),
        "hello_world_ids": ids,
        "hello_world_embedding_head": [round(x, 6) for x in v[:4].tolist()],
        "embedding_size": a.hidden,
        "matryoshka_dimensions": dims,
        "files": sorted(os.listdir(a.out)),
    }))


if __name__ == "__main__":
    sys.exit(main())
