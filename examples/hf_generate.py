"""Hugging Face transformers models generating on swa_tvm's kernels.

Builds a small Mistral-shaped model (every layer sliding) and a GPT-OSS-shaped one
(sliding and full layers, learned sinks) from configs with random weights (nothing is
downloaded), then generates greedily from a left-padded batch of two prompts longer
than the window, once with ``attn_implementation="swa_tvm"`` and once with transformers'
``"eager"``, on the dynamic and on the static cache. It prints the time of each and
checks that the tokens are the same.

Run: ``python examples/hf_generate.py [--new-tokens 48] [--window 16]``
(``pip install 'swa_tvm[transformers]'``).
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import swa_tvm.integrations.transformers as swa_hf

SHAPE = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             intermediate_size=512, vocab_size=1000, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)


def models(window: int):
    yield "Mistral-shaped", transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=window))
    gpt_oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **SHAPE, sliding_window=window, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    for layer in gpt_oss.model.layers:  # random learned sinks (they start at zero)
        torch.nn.init.normal_(layer.self_attn.sinks)
    yield "GPT-OSS-shaped", gpt_oss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--window", type=int, default=16)
    args = p.parse_args(argv)
    swa_hf.register()
    torch.manual_seed(0)
    # Two prompts, 2.5 and 1.5 windows long; the shorter one left-padded.
    long_len, short_len = 5 * args.window // 2, 3 * args.window // 2
    ids = torch.randint(3, SHAPE["vocab_size"], (2, long_len))
    ids[1, : long_len - short_len] = SHAPE["pad_token_id"]
    mask = (ids != SHAPE["pad_token_id"]).long()
    same = True
    for name, model in models(args.window):
        model.eval()
        layers = getattr(model.config, "layer_types", None) or ["sliding_attention"] * SHAPE["num_hidden_layers"]
        print(f"{name}: layers {', '.join(layers)}; window {args.window}; prompts of {long_len} and {short_len} tokens")
        for cache in ("dynamic", "static"):
            config = transformers.GenerationConfig(
                max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=SHAPE["pad_token_id"], eos_token_id=None,
                cache_implementation=None if cache == "dynamic" else "static", disable_compile=True)
            tokens, seconds = {}, {}
            for impl in ("swa_tvm", "eager"):
                model.set_attn_implementation(impl)
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # warm-up (compiles)
                    t0 = time.perf_counter()
                    tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                    seconds[impl] = time.perf_counter() - t0
            equal = torch.equal(tokens["swa_tvm"], tokens["eager"])
            same &= equal
            print(f"  {cache:7s} cache: swa_tvm {seconds['swa_tvm']:.2f} s, eager {seconds['eager']:.2f} s "
                  f"for {args.new_tokens} tokens x 2 prompts; tokens {'identical' if equal else 'DIFFER'}")
        print(f"  first prompt continues: {tokens['swa_tvm'][0, long_len:long_len + 12].tolist()} ...")
    print("all generations identical to eager" if same else "SOME GENERATIONS DIFFER FROM EAGER")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
