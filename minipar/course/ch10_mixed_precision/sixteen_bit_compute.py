"""Chapter 10's two displays of 16-bit compute: a dot product summed in FP32 against one summed in BF16, and
the dtypes ``torch.autocast`` gives operators, outputs and gradients on CPU."""
from __future__ import annotations

import torch

from . import claims


def show_accumulation(n: int = 4096, seed: int = 0) -> None:
    """One n-long dot product of BF16 values, three ways: exactly (FP64), by ``torch.matmul`` (which sums the
    products in FP32 and rounds the result once to BF16, as tensor cores do; Micikevicius et al. 2018 §3.3), and
    by a BF16 running sum that rounds after every addition."""
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.rand(n, generator=g).to(torch.bfloat16) for _ in range(2))
    exact = (a.double() * b.double()).sum().item()
    matmul = (a.view(1, n) @ b.view(n, 1)).item()
    running = torch.zeros((), dtype=torch.bfloat16)
    for product in a * b:
        running = running + product                        # each addition rounded to BF16
    print(f"{n} products of BF16 values in [0, 1): exact sum {exact:.2f}, torch.matmul in BF16 {matmul:g}, "
          f"BF16 running sum {running.item():g}")
    claims.check_accumulation(exact, matmul, running.item())


def show_autocast() -> None:
    """The dtype of each operator's output under ``torch.autocast('cpu', bfloat16)``, beside the one PyTorch's
    autocast documentation lists for CUDA (softmax, log_softmax, layer_norm, cross_entropy and sum are on its
    FP32 list), and the weights' and their gradients' dtypes after a backward."""
    x, w, ln = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True), torch.nn.LayerNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ w
        out = {"matmul": y, "softmax": torch.softmax(y, -1), "layer_norm": ln(y),
               "log_softmax": torch.log_softmax(y, -1),
               "cross_entropy": torch.nn.functional.cross_entropy(y, torch.zeros(4, dtype=torch.long)), "sum": y.sum()}
    (out["cross_entropy"] + out["layer_norm"].float().sum()).backward()     # reaches w and the LayerNorm gain
    cuda = {"matmul": "bfloat16"} | {op: "float32" for op in out if op != "matmul"}    # torch's CUDA autocast lists
    print(f"{'operator output':16}{'CPU (measured here)':>21}{'CUDA (autocast docs)':>22}")
    for op, value in out.items():
        print(f"{op:16}{str(value.dtype).replace('torch.', ''):>21}{cuda[op]:>22}")
    print("the weights stay:", ln.weight.dtype, w.dtype, "; their gradients:", ln.weight.grad.dtype, w.grad.dtype)
    claims.check_autocast_dtypes(out, ln, w)
