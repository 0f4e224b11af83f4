#!/usr/bin/env python3
"""HF's own encodings with add_special_tokens=True for tests/fixtures/tokenizer_post/golden.json:
the post-processors that released tokenizer.json files carry, each put on one of the fixture
tokenizers (tests/fixtures/tokenizer_bpe1000_s0: byte-level; tokenizer_spm_llama2: SentencePiece
kind), built with HF tokenizers' own classes and serialized by HF.
  python3 tools/make_post_goldens.py OUT_DIR      (needs the tokenizers package; run from the repo)
writes OUT_DIR/tokenizer_post/golden.json: for each case its base fixture, the post_processor
JSON as HF writes it, and the probes' ids with and without the special tokens."""
import json
import os
import sys

from tokenizers import Tokenizer, processors

PROBES = ["Hello world!", "", " ", "line one\nline two", "<s>user\nWhat is in the image?</s>",
          "<|im_start|>user\nhi<|im_end|>", "caf\u00e9 \u4f60\u597d \U0001F600", "a" * 50]


def cases(bpe, spm):
    eot, ims, ime = (bpe.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    return [
        ("llama3_like", "tokenizer_bpe1000_s0", processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B:1",
                                          special_tokens=[("<|endoftext|>", eot)])])),
        ("llama2", "tokenizer_spm_llama2", processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)])),
        ("bos_eos", "tokenizer_spm_llama2", processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])),
        ("bert", "tokenizer_spm_llama2", processors.BertProcessing(("</s>", 2), ("<s>", 1))),
        ("roberta", "tokenizer_bpe1000_s0", processors.RobertaProcessing(("<|im_end|>", ime), ("<|im_start|>", ims))),
        ("byte_level", "tokenizer_bpe1000_s0", processors.ByteLevel()),
    ]


def main():
    out = os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "tokenizer_post")
    os.makedirs(out, exist_ok=True)
    base = {n: Tokenizer.from_file(f"tests/fixtures/{n}/tokenizer.json")
            for n in ("tokenizer_bpe1000_s0", "tokenizer_spm_llama2")}
    res = []
    for name, fixture, proc in cases(base["tokenizer_bpe1000_s0"], base["tokenizer_spm_llama2"]):
        tok = Tokenizer.from_str(base[fixture].to_str())
        tok.post_processor = proc
        res.append({"name": name, "fixture": fixture,
                    "post_processor": json.loads(tok.to_str())["post_processor"],
                    "with": [tok.encode(p, add_special_tokens=True).ids for p in PROBES],
                    "without": [tok.encode(p, add_special_tokens=False).ids for p in PROBES]})
    import tokenizers
    json.dump({"tokenizers": tokenizers.__version__, "strings": PROBES, "cases": res},
              open(os.path.join(out, "golden.json"), "w"), ensure_ascii=False, indent=0)
    print("wrote", out, "tokenizers", tokenizers.__version__)


if __name__ == "__main__":
    main()
