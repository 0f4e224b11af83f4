"""kernel_classes.py: one split of a training step's GPU kernels into classes, by kernel name,
used for loom's traces (report.py) and for the PyTorch reference's (torch_busy.py), so
that the two steps' time can be compared class by class.

    products   GEMMs: cuBLAS / cuBLASLt (nvjet, xmma, cutlass, split-K reductions, gemv), loom's
               gemm_sm90, and Triton's matmul templates (torch.compile's mm / bmm kernels)
    attention  flash / cuDNN / flex attention and loom's attn_* kernels (prep and finish included)
    optimizer  AdamW, the EMA, the gradient norm and the step control (PyTorch's fused Adam and
               foreach lerp / multi-tensor kernels)
    loss       cross-entropy rows, the patch-discrimination and InfoNCE losses
    other      norms, activations, residual adds, copies, gathers and scatters, memsets, everything
               else (torch.compile's fused Triton kernels mostly land here)

Names are matched lower-cased, first rule first; a kernel no rule names is "other".
"""
import re

RULES = [
    ("attention", r"attn_|flash|fmha|sdpa|attention|flex|cudnn_prep|cudnn_fix"),
    ("products", r"nvjet|xmma|cutlass|gemm|splitkreduce|gemv|cublas|triton_tem_fused_(mm|bmm|addmm)|"
                 r"matmul"),
    ("optimizer", r"adam|ema_|lerp|multi_tensor|sumsq|step_control|grad_norm|foreach"),
    ("loss", r"(::|^|\s)l?ce_|cross_entropy|xent|nll|log_softmax|logsoftmax|infonce"),
]
CLASSES = [r[0] for r in RULES] + ["other"]
_COMPILED = [(c, re.compile(p)) for c, p in RULES]


def classify(name):
    n = name.lower()
    for c, rx in _COMPILED:
        if rx.search(n):
            return c
    return "other"


def table(per_kernel, steps, title):
    """per_kernel: name -> (calls, ms over the window); prints ms a step by class."""
    by = {c: [0.0, 0.0] for c in CLASSES}
    for name, (calls, ms) in per_kernel.items():
        k = by[classify(name)]
        k[0] += calls / steps
        k[1] += ms / steps
    total = sum(v[1] for v in by.values())
    print(f"\n{title}: kernel time a step by class (each kernel's own span; concurrent kernels count twice)")
    print(f"{'class':<12} {'launches':>9} {'ms/step':>9} {'share':>7}")
    for c in CLASSES:
        calls, ms = by[c]
        print(f"{c:<12} {calls:>9.1f} {ms:>9.3f} {100 * ms / max(total, 1e-9):>6.1f}%")
    print(f"{'sum':<12} {sum(v[0] for v in by.values()):>9.1f} {total:>9.3f}")
