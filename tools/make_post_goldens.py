#!/usr/bin/env python3
"""HF's own encodings with add_special_tokens=True for tests/fixtures/tokenizer_post/golden.json:
the post-processors that released tokenizer.json files carry, each put on one of the fixture
tokenizers (tests/fixtures/tokenizer_bpe1000_s0: byte-level; tokenizer_spm_llama2: SentencePiece
kind), built with HF tokenizers' own classes and serialized by HF.
  python3 tools/make_post_goldens.py OUT_DIR      (needs the tokenizers package; run from the repo)
writes OUT_DIR/tokenizer_post/golden.json: for each case its base fixture, the post_processor
JSON as HF writes it, and the probes' ids with and without the special tokens; and
OUT_DIR/tokenizer_post/pipeline.json: the same cases' pairs, then pairs, single probes and
batches under truncation (with strides) and padding settings (each with the tokenizer.json
sections HF writes for them): ids, type ids, attention and special-tokens masks and the
overflowing windows (nested as HF nests them), or the error HF raised."""
import json
import os
import re
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
    json.dump({"tokenizers": tokenizers.__version__, "strings": PROBES, "runs": pipeline(base)},
              open(os.path.join(out, "pipeline.json"), "w"), ensure_ascii=False, separators=(",", ":"))
    print("wrote", out, "tokenizers", tokenizers.__version__)


def records_windows(name, single):
    """Whether a run keeps HF's overflowing windows: all but the pairs cut to 4 or 8 ids, whose
    nested windows (HF pairs every window of one sequence with every window of the other) would
    make the file megabytes; the pairs cut to 20 and the strided runs have them."""
    return single or not re.search(r" (4|8)$| stride 8 2 ", name)


def encoding(e, windows=True):
    out = {"ids": e.ids, "type_ids": e.type_ids, "attention_mask": e.attention_mask,
           "special_tokens_mask": e.special_tokens_mask}
    if windows and e.overflowing:  # what truncation cut off, windows nested as HF pairs them
        out["overflowing"] = [encoding(o) for o in e.overflowing]
    return out


def pipeline(base):
    """Pairs through every case's post-processor, then truncation and padding settings on two of
    them. Each run: the fixture, its sections as HF writes them, and per pair (probe i, probe
    len-1-i) or per batch the encodings or the error's text."""
    runs = []
    pairs = [(PROBES[i], PROBES[len(PROBES) - 1 - i]) for i in range(len(PROBES))]

    def run(name, fixture, tok, batch=False, single=False):
        sections = json.loads(tok.to_str())
        item = {"name": name, "fixture": fixture,
                "post_processor": sections["post_processor"], "truncation": sections["truncation"],
                "padding": sections["padding"], "results": []}
        if single:  # each probe alone instead of the pairs
            item["single"] = True
        windows = records_windows(name, single)
        item["overflowing_recorded"] = windows  # (false: the encodings leave the windows out)
        for special in (False, True):
            try:
                if batch:
                    got = [encoding(e, windows) for e in tok.encode_batch(PROBES if single else pairs, add_special_tokens=special)]
                elif single:
                    got = [encoding(tok.encode(a, add_special_tokens=special), windows) for a in PROBES]
                else:
                    got = [encoding(tok.encode(a, b, add_special_tokens=special), windows) for a, b in pairs]
                item["results"].append({"add_special_tokens": special, "encodings": got})
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # HF refuses (a stride too long panics: not an Exception): loom must refuse too
                item["results"].append({"add_special_tokens": special, "error": f"{type(err).__name__}: {err}"})
        runs.append(item)

    for name, fixture, proc in cases(base["tokenizer_bpe1000_s0"], base["tokenizer_spm_llama2"]):
        tok = Tokenizer.from_str(base[fixture].to_str())
        tok.post_processor = proc
        run(name + " pairs", fixture, tok)
        # overflowing windows: every post-processor, one sequence and pairs, both directions
        for max_length, stride in ((8, 2), (20, 5)):
            for direction in ("right", "left"):
                t = Tokenizer.from_str(tok.to_str())
                t.enable_truncation(max_length, stride=stride, direction=direction)
                run(f"{name} stride {max_length} {stride} {direction} single", fixture, t, single=True)
                if max_length > 8:  # (the pairs' windows at 8 would be megabytes: records_windows)
                    run(f"{name} stride {max_length} {stride} {direction}", fixture, t)
        if name not in ("bert", "llama3_like"):
            continue
        for strategy in ("only_first", "only_second"):
            t = Tokenizer.from_str(tok.to_str())
            t.enable_truncation(12, stride=1, strategy=strategy)
            run(f"{name} stride 12 1 {strategy}", fixture, t)
        for strategy in ("longest_first", "only_first", "only_second"):
            for direction in ("right", "left"):
                for max_length in (4, 8, 20):  # not under the 3 ids BERT adds to a pair: HF's max_length - added would wrap
                    t = Tokenizer.from_str(tok.to_str())
                    t.enable_truncation(max_length, stride=0, strategy=strategy, direction=direction)
                    run(f"{name} truncation {strategy} {direction} {max_length}", fixture, t)
        for length, multiple, direction in ((None, None, "right"), (None, 8, "left"), (40, None, "right"),
                                            (4, 16, "left")):
            t = Tokenizer.from_str(tok.to_str())
            t.enable_truncation(24)
            t.enable_padding(direction=direction, pad_id=3, pad_type_id=5, pad_token="<0x41>", length=length,
                             pad_to_multiple_of=multiple)
            run(f"{name} padding {length} {multiple} {direction}", fixture, t, batch=True)
        t = Tokenizer.from_str(tok.to_str())  # windows padded with the encodings, one sequence at a time
        t.enable_truncation(10, stride=3)
        t.enable_padding(pad_id=3, pad_type_id=5, pad_token="<0x41>")
        run(f"{name} stride padding single", fixture, t, batch=True, single=True)
    return runs


if __name__ == "__main__":
    main()
