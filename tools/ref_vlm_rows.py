#!/usr/bin/env python3
"""Writes the packed rows of the PyTorch reference's vlm_sft bench batch as a data.synth_rows file.

torch_ref.py's `bench --workload vlm` trains one fixed batch: 8 rows of 2048 tokens picked from a
packing of 4096 synthetic samples (its vlm_batch, packed). This asks the reference for that batch
(it imports torch_ref.py and calls the function the bench calls, so nothing is restated here) and
writes one line per row with the lengths of its samples in tokens, image tokens included:

    python3 tools/ref_vlm_rows.py --out rows.txt [--reference ../shared/reference]
    ./train bench_vlm_sft.cfg --data.synth_rows=rows.txt --data.repeat_batch=true

Then loom trains the same documents (the same image count, the same lengths in each row, the same
tokens without a target) as the reference, so the two tokens/s compare the same work; loom's own
packing of its 20000 samples averages 6.75 samples a row (54 images a step), the reference's batch
holds 41 (bench/RESULTS.md, 2026-11-29).
Needs torch (the reference imports it); runs on the CPU.
"""
import argparse
import os
import sys
import types


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the rows file to write")
    ap.add_argument("--reference", default=os.path.join("..", "shared", "reference"),
                    help="folder of torch_ref.py (default ../shared/reference)")
    ap.add_argument("--seq-len", type=int, default=2048, help="the reference's --seq-len (default 2048)")
    ap.add_argument("--vlm-rows", type=int, default=8, help="the reference's --vlm-rows (default 8)")
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.reference, "torch_ref.py")):
        sys.exit(f"{a.reference}: no torch_ref.py there (--reference names its folder)")
    sys.path.insert(0, a.reference)
    try:
        import torch_ref  # noqa: E402  (the reference, from the folder given)
    except ImportError as e:
        sys.exit(f"{a.reference}/torch_ref.py cannot be imported here ({e}): it needs PyTorch")

    image_tokens = torch_ref.ViTConfig().num_patches // 4  # as its bench_vlm: 2 x 2 pixel shuffle
    docs, row_len = torch_ref.vlm_batch(types.SimpleNamespace(seq_len=a.seq_len, vlm_rows=a.vlm_rows),
                                        image_tokens, True)
    real = sum(map(sum, docs))
    with open(a.out, "w") as f:
        f.write(f"# torch_ref.py vlm_batch (packed): {len(docs)} rows of {row_len} tokens, "
                f"{sum(map(len, docs))} samples, {real} real tokens; {image_tokens} image tokens a sample\n")
        for d in docs:
            f.write(" ".join(str(L) for L in d) + "\n")
    print(f"{a.out}: {len(docs)} rows, {sum(map(len, docs))} samples, {real} real tokens")


if __name__ == "__main__":
    main()
