"""``python -m benchmarks.hf_models``: transformers models generating on swa_tvm and on
transformers' own attention, every method in one process on the same model and prompt.

Models (random weights from configs, float32, 4 layers, vocabulary 1024):

* Mistral-shaped: hidden 4096, 32 heads over 8 KV heads, head dim 128, MLP 14336,
  every layer sliding with W=4096; methods ``swa_tvm``, ``sdpa`` and ``eager``;
* GPT-OSS-shaped: hidden 2880, 64 heads over 8 KV heads, head dim 64, sliding (W=128)
  and full layers alternating, learned sinks, 4 experts of 2880 (2 per token; GPT-OSS
  20B has 32, 4 per token: fewer keep the weights in memory, the attention is its
  own); methods ``swa_tvm`` and ``eager`` (transformers refuses ``sdpa`` for it).

Each method prefills the prompt (8192 tokens; the whole prompt in one forward) into a
dynamic cache, then generates 128 tokens greedily, one forward per token; ``--runs``
rounds time every method once each, round-robin, and the median run of each phase is
reported. The time of the attention function of every layer is summed apart (the
kernels, through the registered function of each method; the masks are built outside
it for every method). Reported: prefill seconds and tokens/s, decode tokens/s,
end-to-end seconds (prefill + 128 steps), attention's share of each, and attention
milliseconds per decoded token. The generated tokens of every method are compared with
the first's.

``eager`` materialises every layer's scores (H x T x T float32: 8.6 GB for 32 heads at
8192, two or three of them alive at once), more than this machine holds, so its prompt
goes in chunks (``--eager-chunk``, 2048 by default: 2.1 GB of scores). That also cuts
its arithmetic: a chunk's scores cover only the keys its cache holds (on a sliding
layer the window's), about half of the T x T scores of the whole prompt at W=4096, so
eager's prefill is timed doing less work than in one forward. Writes
``hf_models.json`` under benchmarks/results/<target-key>/.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import sys
import time

import torch
import transformers

import swa_tvm
import swa_tvm.integrations.transformers as swa_hf
from benchmarks.forward import machine_info, write_results

VOCAB = 1024
MODELS = {
    "Mistral-shaped": (
        "mistral",
        dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
             sliding_window=4096),
        ("swa_tvm", "sdpa", "eager"),
    ),
    "GPT-OSS-shaped": (
        "gpt_oss",
        dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
             sliding_window=128, num_local_experts=4, num_experts_per_tok=2,
             rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
        ("swa_tvm", "eager"),
    ),
}
CONFIG_CLASSES = {"mistral": "MistralConfig", "gpt_oss": "GptOssConfig"}
MODEL_CLASSES = {"mistral": "MistralForCausalLM", "gpt_oss": "GptOssForCausalLM"}


class AttentionClock:
    """Seconds spent in the attention function of every layer, per method: each
    method's function wrapped where the model looks it up (the interface registry for
    ``swa_tvm`` and ``sdpa``, the modeling module's ``eager_attention_forward``)."""

    def __init__(self, family: str):
        self.seconds = 0.0
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        sdpa = transformers.AttentionInterface._global_mapping["sdpa"]
        transformers.AttentionInterface.register("swa_tvm", self.wrap(swa_hf.attention))
        transformers.AttentionInterface.register("sdpa", self.wrap(sdpa))
        self._restore = (modeling, modeling.eager_attention_forward, sdpa)
        modeling.eager_attention_forward = self.wrap(modeling.eager_attention_forward)

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def close(self) -> None:
        modeling, eager, sdpa = self._restore
        modeling.eager_attention_forward = eager
        transformers.AttentionInterface.register("sdpa", sdpa)
        swa_hf.register()


def build(family: str, shape: dict, layers: int):
    config = getattr(transformers, CONFIG_CLASSES[family])(
        num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=65536, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **shape)
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_CLASSES[family])(config).eval()
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            torch.nn.init.normal_(layer.self_attn.sinks)
    return model


def prefill(model, clock: AttentionClock, ids, chunk: int | None):
    """(seconds, attention seconds, the cache, the first generated token): ``ids`` into
    a new dynamic cache, in chunks of ``chunk`` if given."""
    with torch.no_grad():
        clock.seconds = 0.0
        t0 = time.perf_counter()
        cache = transformers.DynamicCache(config=model.config)
        step = chunk or ids.shape[1]
        for s in range(0, ids.shape[1], step):
            logits = model(input_ids=ids[:, s : s + step], cache=cache, use_cache=True, logits_to_keep=1).logits
        seconds = time.perf_counter() - t0
    return seconds, clock.seconds, cache, logits[:, -1].argmax(-1, keepdim=True)


def decode(model, clock: AttentionClock, cache, first, new_tokens: int):
    """(seconds, attention seconds, tokens): ``new_tokens`` - 1 greedy steps after
    ``first``, one forward each, on a copy of ``cache``."""
    with torch.no_grad():
        cache = copy.deepcopy(cache)  # every run decodes from the same prefilled state
        token, out = first, [first]
        clock.seconds = 0.0
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            logits = model(input_ids=token, cache=cache, use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            out.append(token)
        seconds = time.perf_counter() - t0
    return seconds, clock.seconds, torch.cat(out, dim=1)[0].tolist()


def summarize(prefills: list, decodes: list, prompt: int, new_tokens: int, chunk: int | None) -> dict:
    """One method's row from its runs: the median run of each phase."""
    p_s, p_attn = sorted(prefills)[len(prefills) // 2]
    d_s, d_attn = sorted(decodes)[len(decodes) // 2]
    steps = new_tokens - 1
    return {
        "prefill_runs_s": [p for p, _ in prefills], "prefill_s": p_s, "prefill_tokens_per_s": prompt / p_s,
        "prefill_attention_s": p_attn, "prefill_attention_share": p_attn / p_s, "prefill_chunk": chunk,
        "decode_runs_s": [d for d, _ in decodes], "decode_tokens_per_s": steps / d_s,
        "decode_ms_per_token": 1e3 * d_s / steps, "decode_attention_share": d_attn / d_s,
        "decode_attention_ms_per_token": 1e3 * d_attn / steps, "end_to_end_s": p_s + d_s,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="runs of every method, round-robin (medians reported)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--eager-chunk", type=int, default=2048, help="eager's prefill chunk (0: the whole prompt)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<target-key>)")
    args = p.parse_args(argv)
    swa_hf.register()
    ids = torch.randint(3, VOCAB, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    rows = []
    for name in args.models:
        family, shape, methods = MODELS[name]
        model = build(family, shape, args.layers)
        clock = AttentionClock(family)
        chunks = {impl: (args.eager_chunk or None) if impl == "eager" else None for impl in methods}
        prefills = {impl: [] for impl in methods}
        decodes = {impl: [] for impl in methods}
        tokens = {}
        try:
            for impl in methods:  # warm-up at a short prompt: swa_tvm compiles its kernels on first use
                model.set_attn_implementation(impl)
                _, _, cache, first = prefill(model, clock, ids[:, :256], None)
                decode(model, clock, cache, first, 4)
            # Round-robin: each run times every method once, so that a slow spell of the
            # shared machine lands on all of them.
            for run in range(args.runs):
                for impl in methods:
                    model.set_attn_implementation(impl)
                    p_s, p_attn, cache, first = prefill(model, clock, ids, chunks[impl])
                    d_s, d_attn, tokens[impl] = decode(model, clock, cache, first, args.new_tokens)
                    prefills[impl].append((p_s, p_attn))
                    decodes[impl].append((d_s, d_attn))
                    print(f"{name:15s} {impl:8s} run {run + 1}: prefill {p_s:.1f} s (attention {p_attn:.1f} s), "
                          f"decode {d_s:.1f} s (attention {d_attn:.2f} s)", flush=True)
        finally:
            clock.close()
        for impl in methods:
            row = {"model": name, "method": impl, "tokens": tokens[impl],
                   **summarize(prefills[impl], decodes[impl], args.prompt, args.new_tokens, chunks[impl])}
            rows.append(row)
            print(f"{name:15s} {impl:8s} prefill {row['prefill_s']:.1f} s ({row['prefill_tokens_per_s']:.0f} tok/s, "
                  f"attention {100 * row['prefill_attention_share']:.0f}%), decode "
                  f"{row['decode_tokens_per_s']:.2f} tok/s (attention {row['decode_attention_ms_per_token']:.1f} "
                  f"ms/token, {100 * row['decode_attention_share']:.0f}%), end to end {row['end_to_end_s']:.1f} s",
                  flush=True)
        del model
    first = {}
    for row in rows:
        want = first.setdefault(row["model"], row["tokens"])
        row["tokens_match_first_method"] = row["tokens"] == want
    result = {
        "command": "python -m benchmarks.hf_models " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(torch.get_num_threads()),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tvm": swa_tvm.runtime.library.tvm_version(), "swa_tvm": swa_tvm.__version__},
        "prompt": args.prompt, "new_tokens": args.new_tokens, "layers": args.layers, "runs": args.runs,
        "eager_chunk": args.eager_chunk or None,
        "models": {n: dict(MODELS[n][1]) for n in args.models},
        "rows": rows,
    }
    write_results(result, "hf_models.json", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
