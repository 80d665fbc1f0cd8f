"""StreamingLLM-style generation: a rolling window with pinned sinks, through 8x the window.

A small decoder (randomly initialised, no download) samples token by token, with one ``swa_tvm.RollingKVCache`` per layer: 4 sink positions pinned, then a
ring of the window's slots. The example

* prints the caches' memory at checkpoints: flat once the window is full;
* checks every step of every layer against a full-sequence call
  (``swa_tvm.sliding_window_attention``) on the tokens still in view (the sinks and the
  window), kept here for the check only.

Run: ``python examples/streaming_generate.py [--window 32] [--sinks 4] [--factor 8]``.
"""

from __future__ import annotations

import argparse
import time

import torch

import swa_tvm

VOCAB, D_MODEL, HEADS, KV_HEADS, LAYERS = 97, 64, 4, 2, 2
HEAD_DIM = D_MODEL // HEADS


class Decoder(torch.nn.Module):
    """Embedding, pre-norm attention + MLP blocks, tied output. No position encoding:
    which keys a query sees is the attention's window and sinks."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(D_MODEL, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False) for _ in range(LAYERS)
        )
        self.proj = torch.nn.ModuleList(torch.nn.Linear(D_MODEL, D_MODEL, bias=False) for _ in range(LAYERS))
        self.mlp = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(D_MODEL, 4 * D_MODEL), torch.nn.GELU(), torch.nn.Linear(4 * D_MODEL, D_MODEL))
            for _ in range(LAYERS)
        )
        self.norm = torch.nn.ModuleList(torch.nn.RMSNorm(D_MODEL) for _ in range(2 * LAYERS + 1))

    def step(self, tokens, caches, on_attention=None):
        """Logits [B, T, VOCAB] of the next T tokens, appended to the caches."""
        x = self.embed(tokens)
        B, T, _ = x.shape
        for i, cache in enumerate(caches):
            h = self.qkv[i](self.norm[2 * i](x)).view(B, T, HEADS + 2 * KV_HEADS, HEAD_DIM).transpose(1, 2)
            q, k, v = h.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
            a = cache.attend(q, k, v)
            if on_attention is not None:
                on_attention(i, q, k, v, a)
            x = x + self.proj[i](a.transpose(1, 2).reshape(B, T, D_MODEL))
            x = x + self.mlp[i](self.norm[2 * i + 1](x))
        return self.norm[-1](x) @ self.embed.weight.T


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=int, default=32, help="keys a query sees, itself included")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--factor", type=int, default=8, help="generate this many windows of tokens")
    p.add_argument("--prompt", type=int, default=8)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = Decoder().eval()
    caches = [swa_tvm.RollingKVCache(1, KV_HEADS, HEAD_DIM, window=args.window, num_sinks=args.sinks, max_chunk=args.prompt)
              for _ in range(LAYERS)]
    history = [([], []) for _ in range(LAYERS)]  # every position's k and v, for the check only
    worst = [0.0]

    def check(layer, q, k, v, out):
        ks, vs = history[layer]
        ks.append(k)
        vs.append(v)
        keys, values = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        n = keys.shape[2]
        for t in range(q.shape[2]):  # each new query, at position n - T + t
            pos = n - q.shape[2] + t
            view = sorted(set(range(min(args.sinks, pos + 1))) | set(range(max(0, pos - args.window + 1), pos + 1)))
            idx = torch.tensor(view)
            kv, vv = keys[:, :, idx], values[:, :, idx]
            # The tokens in view as one sequence, causal: its last row is this query's.
            qv = torch.cat([torch.zeros(1, HEADS, len(view) - 1, HEAD_DIM), q[:, :, t : t + 1]], dim=2)
            want = swa_tvm.sliding_window_attention(qv, kv, vv, window_size=(-1, 0))[:, :, -1]
            worst[0] = max(worst[0], (out[:, :, t] - want).abs().max().item())

    steps = args.factor * args.window
    sampler = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, args.prompt), generator=sampler)
    generated = []
    start = time.perf_counter()
    with torch.no_grad():
        logits = model.step(tokens, caches, check)
        def sample(logits):
            return torch.multinomial(torch.softmax(logits[:, -1], dim=-1), 1, generator=sampler)

        nxt = sample(logits)
        for s in range(1, steps + 1):
            generated.append(int(nxt))
            logits = model.step(nxt, caches, check)
            nxt = sample(logits)
            if s % args.window == 0:
                memory = sum(c.nbytes for c in caches)
                print(f"position {caches[0].position:5d}: cache memory {memory} bytes "
                      f"({caches[0].k.shape[2]} slots a layer), worst difference so far {worst[0]:.2e}")
    elapsed = time.perf_counter() - start
    print(f"generated {steps} tokens ({args.factor}x the window of {args.window}, {args.sinks} sinks) "
          f"in {elapsed:.1f} s; first tokens {generated[:12]}")
    ok = worst[0] < 1e-5
    print(f"every step equals the full-sequence call on the tokens in view: {'yes' if ok else 'NO'} "
          f"(worst difference {worst[0]:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
