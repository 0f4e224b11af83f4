#!/usr/bin/env python3
"""check_hf_export.py: load a folder written by `./train export RUN --hf DIR` with HF transformers
and write fixtures that `./train check` compares loom against.

    python3 tools/check_hf_export.py DIR OUT [--seed N]

Needs only torch, transformers (and its tokenizers / safetensors). It checks, and exits non-zero
on the first failure:
  - AutoTokenizer.from_pretrained(DIR) loads; the chat template renders a conversation exactly
    as loom's data/chat.h writes it ("<|im_start|>{role}\\n{content}<|im_end|>\\n" per turn, the
    generation prompt "<|im_start|>assistant\\n"), the rendered text encodes with <|im_start|> and
    <|im_end|> as single ids and decodes back to itself; bos/eos/pad are <|im_start|>,
    <|im_end|>, <|endoftext|>. OUT/chat.txt and OUT/chat_ids.json hold the text and HF's ids
    (tools/check_hf_export.sh compares them with `./train tokenize`).
  - AutoModelForCausalLM.from_pretrained(DIR) is a float32 LlamaForCausalLM with its head tied
    to the embeddings; greedy generate() runs with the folder's generation_config.
  - OUT/llama/: the same model in float64 on a fixed batch of token ids (row 0 the encoded
    conversation, row 1 random ids): config.json and model.safetensors copied from DIR, and
    golden.safetensors with input.ids, input.labels, output.logits, output.loss (HF shifts the
    labels inside the model) and grad.* under HF names: the format of
    tests/fixtures/llama_tiny_s0, so `./train check OUT/llama --device cpu|cuda` rebuilds loom's
    LM from DIR and compares logits, loss and every gradient.
  - OUT/vision/ (when DIR/vision exists): SiglipVisionModel.from_pretrained(DIR/vision) in
    float64, random pixels x and R, last_hidden_state and the gradients of sum(h * R): the format
    of tests/fixtures/siglip_tiny_s0.
"""
import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def fail(msg):
    print(f"check_hf_export: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def expect(cond, msg):
    if not cond:
        fail(msg)
    print(f"  ok  {msg}")


def chatml(conv, generation_prompt=False):
    """loom's chat format (data/chat.h), written out by hand."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def check_tokenizer(d, out):
    print(f"tokenizer: AutoTokenizer.from_pretrained({d})")
    tok = AutoTokenizer.from_pretrained(d)
    expect(tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>",
           f"special tokens bos {tok.bos_token!r}, eos {tok.eos_token!r}, pad {tok.pad_token!r}")
    conv = [{"role": "user", "content": "What colour is the circle in the top left?"},
            {"role": "assistant", "content": "red"}]
    text = tok.apply_chat_template(conv, tokenize=False)
    expect(text == chatml(conv), f"chat template renders loom's ChatML: {text!r}")
    prompt = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    expect(prompt == chatml(conv[:1], True), "add_generation_prompt appends '<|im_start|>assistant\\n'")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    expect(ids[0] == im_start and ids.count(im_start) == 2 and ids.count(im_end) == 2,
           f"the conversation encodes to {len(ids)} ids with <|im_start|>/<|im_end|> as single ids")
    expect(tok.decode(ids) == text, "decode(encode(text)) == text")
    with open(os.path.join(out, "chat.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(text)
    with open(os.path.join(out, "chat_ids.json"), "w") as f:
        json.dump(ids, f)
    return tok, ids, tok(prompt, add_special_tokens=False)["input_ids"]


def check_llama(d, out, ids, prompt_ids, seed, T):
    print(f"model: AutoModelForCausalLM.from_pretrained({d})")
    m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    m.eval()
    expect(type(m).__name__ == "LlamaForCausalLM", f"class {type(m).__name__}")
    expect(m.dtype == torch.float32, f"dtype {m.dtype}")
    expect(m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr(), "lm_head tied to embed_tokens")
    V = m.config.vocab_size
    with torch.no_grad():
        p = torch.tensor([prompt_ids])
        gen = m.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=8, do_sample=False)
    print(f"  greedy continuation of the text-only prompt (no image): {gen[0, len(prompt_ids):].tolist()}")
    g = torch.Generator().manual_seed(seed)
    B = 2
    batch = torch.randint(0, V, (B, T), generator=g)
    n = min(T, len(ids))
    batch[0, :n] = torch.tensor(ids[:n])
    labels = batch.clone()
    labels[:, :3] = -100
    with torch.no_grad():
        logits32 = m(input_ids=batch).logits.double()
    m = m.double()
    o = m(input_ids=batch, labels=labels)
    o.loss.backward()
    print(f"  transformers f32 vs f64 logits: max abs diff {(logits32 - o.logits.detach()).abs().max().item():.3e}")
    fx = os.path.join(out, "llama")
    os.makedirs(fx)
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(d, f), fx)
    t = {"input.ids": batch, "input.labels": labels, "output.logits": o.logits.detach(),
         "output.loss": o.loss.detach().reshape(1)}
    for k, p in m.named_parameters():
        if p.grad is not None and k != "lm_head.weight":  # tied: its gradient is in embed_tokens'
            t[f"grad.{k}"] = p.grad
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(fx, "golden.safetensors"),
              metadata={"note": "transformers float64; HF loss shifts labels by one inside the model"})
    print(f"  wrote {fx} (logits [{B}, {T}, {V}], loss {o.loss.item():.6f}, {len(t) - 4} gradients)")


def check_siglip(vd, out, seed):
    from transformers import SiglipVisionModel
    print(f"vision: SiglipVisionModel.from_pretrained({vd})")
    m = SiglipVisionModel.from_pretrained(vd, attn_implementation="eager")
    expect(m.dtype == torch.float32, f"dtype {m.dtype}")
    try:
        from transformers import AutoImageProcessor
        AutoImageProcessor.from_pretrained(vd)
        print("  ok  AutoImageProcessor loads preprocessor_config.json")
    except Exception as e:  # the processor may need Pillow / torchvision, which this check does not
        print(f"  (AutoImageProcessor did not load, not part of the check: {type(e).__name__}: {e})")
    c = m.config
    m = m.double()
    g = torch.Generator().manual_seed(seed + 1)
    px = torch.randn(2, c.num_channels, c.image_size, c.image_size, generator=g, dtype=torch.float64,
                     requires_grad=True)
    h = m(pixel_values=px).last_hidden_state
    R = torch.randn(h.shape, generator=g, dtype=torch.float64)
    (h * R).sum().backward()
    fx = os.path.join(out, "vision")
    os.makedirs(fx)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(vd, f), fx)
    t = {"input.pixel_values": px.detach(), "input.R": R, "output.last_hidden_state": h.detach(),
         "grad.pixel_values": px.grad}
    t.update({f"grad.{k}": p.grad for k, p in m.named_parameters() if p.grad is not None})
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(fx, "golden.safetensors"),
              metadata={"note": "transformers float64; loss = sum(last_hidden_state * R)"})
    print(f"  wrote {fx} (last_hidden_state {list(h.shape)})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="a folder written by ./train export RUN --hf DIR")
    ap.add_argument("out", help="a new folder for chat.txt, chat_ids.json, llama/ and vision/")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per row of the fixed batch")
    a = ap.parse_args()
    if os.path.exists(a.out) and os.listdir(a.out):
        fail(f"{a.out} exists and is not empty")
    os.makedirs(a.out, exist_ok=True)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(a.seed)
    _, ids, prompt_ids = check_tokenizer(a.dir, a.out)
    check_llama(a.dir, a.out, ids, prompt_ids, a.seed, a.tokens)
    vd = os.path.join(a.dir, "vision")
    if os.path.isdir(vd):
        check_siglip(vd, a.out, a.seed)
    print("check_hf_export: transformers side done")


if __name__ == "__main__":
    main()
