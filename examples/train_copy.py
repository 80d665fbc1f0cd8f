"""Train a tiny two-layer model with swa_tvm attention on a synthetic copy task.

Gemma-style interleaving: layer 1 is local (causal sliding window of 8 keys plus one
StreamingLLM sink), layer 2 is global (causal, unbounded window). Both use GQA (4 query
heads, 2 k/v heads). The task: a random string of L tokens, a separator, then the same
string again; the loss counts only the copied half. The copy source lies L+1 positions
back, outside the local window, so the model must learn to route through the global
layer. The gradients come from swa_tvm's backward kernels via torch.autograd.

    python examples/train_copy.py [--steps 300] [--device cuda [--attn-dtype bfloat16]]

On CUDA the attention (forward and backward) runs in ``--attn-dtype`` (float16 and
bfloat16 accumulate in float32), the rest of the model in float32.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn

import swa_tvm

VOCAB, SEP = 16, 16  # tokens 0..15, separator 16


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, window: tuple[int, int], num_sinks: int,
                 attn_dtype=torch.float32):
        super().__init__()
        self.attn_dtype = attn_dtype
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.window, self.num_sinks = window, num_sinks
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.proj = nn.Linear(heads * self.hd, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
        q = q.view(B, T, self.heads, self.hd).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        dt = self.attn_dtype
        a = swa_tvm.sliding_window_attention(q.to(dt), k.to(dt), v.to(dt), window_size=self.window,
                                             num_sinks=self.num_sinks).to(x.dtype)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.norm2(x))


class CopyModel(nn.Module):
    def __init__(self, T: int, dim: int = 64, heads: int = 4, kv_heads: int = 2, window: int = 8,
                 attn_dtype=torch.float32):
        super().__init__()
        self.tok = nn.Embedding(VOCAB + 1, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(T, dim))
        self.blocks = nn.ModuleList(
            [
                Block(dim, heads, kv_heads, (window - 1, 0), num_sinks=1, attn_dtype=attn_dtype),  # local
                Block(dim, heads, kv_heads, (-1, 0), num_sinks=0, attn_dtype=attn_dtype),  # global
            ]
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def batch(n: int, L: int, g: torch.Generator):
    s = torch.randint(0, VOCAB, (n, L), generator=g)
    seq = torch.cat([s, torch.full((n, 1), SEP), s], dim=1)
    # Predict token t+1 from tokens <= t; only the copied half is scored.
    return seq[:, :-1], seq[:, 1:], slice(L, 2 * L)


def train(steps: int = 300, L: int = 12, batch_size: int = 32, lr: float = 3e-3, seed: int = 0, log_every: int = 50,
          device: str = "cpu", attn_dtype=torch.float32):
    """Returns the list of per-step losses."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = CopyModel(T=2 * L, attn_dtype=attn_dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    t0 = time.time()
    for step in range(1, steps + 1):
        x, y, scored = batch(batch_size, L, g)
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits[:, scored].reshape(-1, VOCAB), y[:, scored].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == 1):
            acc = (logits[:, scored].argmax(-1) == y[:, scored]).float().mean().item()
            print(f"step {step:4d}  loss {loss.item():.3f}  copy accuracy {acc:.2f}  ({time.time() - t0:.0f}s)")
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (kernels compiled with nvcc on first use)")
    p.add_argument("--attn-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="dtype of the attention on CUDA (the CPU kernels take float32)")
    args = p.parse_args(argv)
    if args.device == "cpu" and args.attn_dtype != "float32":
        p.error("--attn-dtype float16/bfloat16 needs --device cuda")
    losses = train(args.steps, seed=args.seed, device=args.device, attn_dtype=getattr(torch, args.attn_dtype))
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"mean loss of the first 10 steps {first:.3f} (chance: ln {VOCAB} = {math.log(VOCAB):.3f}), "
          f"of the last 10 {last:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
