#!/usr/bin/env python3
"""Make the SentencePiece-kind tokenizer.json fixtures (tests/fixtures/tokenizer_spm_*) with HF
tokenizers, and their goldens through ../shared/reference/torch_ref.py's probe list.

The files Llama 2, Mistral and Gemma ship are BPE models converted from SentencePiece: no
byte-level alphabet, spaces written as U+2581, unknown characters spelled as <0xXX> byte tokens
(byte_fallback), and one of three front ends:
  llama2   normalizer Sequence[Prepend("\u2581"), Replace(" ", "\u2581")], no pre-tokenizer
  gemma    normalizer Replace(" ", "\u2581"), no pre-tokenizer (no prefix space)
  mistral  no normalizer, pre-tokenizer Metaspace("\u2581", prepend_scheme="first", split=false)
Each is trained here on the same text (the Python standard library) to a small vocabulary,
then laid out as the real files are: <unk>, <s>, </s> (ids 0-2), the 256 byte tokens
<0x00>..<0xFF> (ids 3-258), then the learned pieces.
  python3 tools/make_spm_tokenizers.py OUT_DIR      (needs the tokenizers package)
writes OUT_DIR/tokenizer_spm_<kind>/tokenizer.json and golden.json (strings, ids, decoded).
"""
import glob
import json
import os
import random
import sys

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

PROBES = [
    "Hello world!", "  leading spaces and trailing   ", "line one\nline two\n\n\tindented",
    "Numbers: 3.14159, 2026-11-22, 1234567890", "caf\u00e9 na\u00efve \u00fcber", "\u4f60\u597d\uff0c\u4e16\u754c",
    "emoji \U0001F600\U0001F680 mixed", "<s>user\nWhat is in the image?</s>\n",
    "don't won't it's we're they've I'd", "CamelCaseIdentifiers and snake_case_names()", "",
    "a" * 300, "\u0000\u0001 control \u007f chars", "\u00c3\u00a9\u00c3\u00a8 mojibake", " ", "\u2581already a piece",
]
SP = "\u2581"


def front_end(kind):
    if kind == "llama2":
        return normalizers.Sequence([normalizers.Prepend(SP), normalizers.Replace(" ", SP)]), None
    if kind == "gemma":
        return normalizers.Replace(" ", SP), None
    if kind == "mistral":
        return None, pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="first", split=False)
    raise SystemExit("kind: llama2 | gemma | mistral")


def decoder(kind):
    steps = [decoders.Replace(SP, " "), decoders.ByteFallback(), decoders.Fuse()]
    if kind == "llama2":
        steps.append(decoders.Strip(" ", 1, 0))
        return decoders.Sequence(steps)
    if kind == "mistral":
        return decoders.Metaspace(replacement=SP, prepend_scheme="first", split=False)
    return decoders.Sequence(steps)


def make(kind, files, held_out, out, vocab=800):
    norm, pre = front_end(kind)
    # 1. learn merges on the normalized text (the trainer runs the normalizer and pre-tokenizer)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if norm: tok.normalizer = norm
    if pre: tok.pre_tokenizer = pre
    tr = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=200,
                             show_progress=False)
    tok.train(files, tr)
    learned = json.loads(tok.to_str())
    # 2. lay the vocabulary out as SentencePiece conversions do: specials, 256 bytes, pieces
    specials = ["<unk>", "<s>", "</s>"]
    order = specials + ["<0x%02X>" % b for b in range(256)]
    for piece, _ in sorted(learned["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in order: order.append(piece)
    m = learned["model"]
    m["vocab"] = {p: i for i, p in enumerate(order)}
    m["byte_fallback"], m["fuse_unk"], m["unk_token"] = True, True, "<unk>"
    learned["added_tokens"] = [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False,
                                    special=True) for i, s in enumerate(specials)]
    tok = Tokenizer.from_str(json.dumps(learned))
    tok.decoder = decoder(kind)
    d = os.path.join(out, "tokenizer_spm_" + kind)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    probes = PROBES + [open(f, errors="replace").read()[:3000] for f in held_out]
    enc = [tok.encode(p, add_special_tokens=False).ids for p in probes]
    json.dump({"kind": kind, "strings": probes, "ids": enc,
               "tokens": [tok.encode(p, add_special_tokens=False).tokens for p in probes],
               "decoded": [tok.decode(e, skip_special_tokens=False) for e in enc]},
              open(os.path.join(d, "golden.json"), "w"), ensure_ascii=False, indent=0)
    print("wrote", d, "vocab", tok.get_vocab_size())


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    random.Random(0).shuffle(files)
    for kind in ("llama2", "gemma", "mistral"):
        make(kind, files[:60], files[60:63], out)
    import tokenizers
    print("tokenizers", tokenizers.__version__)


if __name__ == "__main__":
    main()
