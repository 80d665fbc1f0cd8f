"""``attn_implementation="swa_tvm"`` in Hugging Face transformers models, against the
same models on transformers' own eager attention: tiny random-weight Mistral, Qwen2
(one full and one sliding layer), Gemma 2 (softcap), Gemma 3 (sliding, full and
bidirectional) and GPT-OSS (learned sinks), built from configs (nothing downloaded).

Prefill logits, greedy ``generate()`` on the dynamic and the static cache (whose
sliding layers shift), chunked prefill, left-padded batches against each prompt alone,
bfloat16 against the error eager itself has, and the gradients of training."""

import os

import pytest
import torch
import transformers  # the Makefile installs the extra: missing, it is a failure, not a skip

import swa_tvm.integrations.transformers as swa_hf

pytestmark = pytest.mark.xdist_group("transformers")

WINDOW = 8
# Weights of std 0.2 (transformers' default is 0.02) give scores of order 1, so that
# softcap, scaling and the sinks change the logits well past the tests' tolerances.
COMMON = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, intermediate_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, initializer_range=0.2)
# Every model's layers: a sliding one (W=8) and, but for Mistral, a full one. GPT-OSS
# routes each token through all 4 of its experts: with top-2 routing a rounding-level
# difference in a hidden state can switch a token's experts, which says nothing about
# attention.
MODELS = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=1)),
    # Gemma's scaling is query_pre_attn_scalar ** -0.5, here not head_dim ** -0.5; a
    # softcap of 0.5 changes the logits (test_the_options_matter).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=64,
                                                         attn_logit_softcapping=0.5)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=64,
                                                             layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(sliding_window=WINDOW, num_local_experts=4,
                                                          num_experts_per_tok=4,
                                                          rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0})),
}
QUICK = ("mistral", "qwen2")


def _models(*quick):
    return [m if m in quick else pytest.param(m, marks=pytest.mark.slow) for m in MODELS]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    swa_hf.register()


def build(name, seed=0, **overrides):
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**COMMON, **{**extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    # The learned sinks start at zero: random ones, so that they matter.
    for layer in getattr(model.model, "layers", []):
        if hasattr(layer.self_attn, "sinks"):
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    return model


def run(model, impl, fn):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return fn()


def prompt(length, seed, batch=1):
    return torch.randint(3, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, mask=None, new=32, cache=None, chunk=None):
    """(new tokens [B, new], the logits of every step [B, new, vocab])."""
    # min_new_tokens: the model's end token (its config's, which generate() falls back on)
    # never ends a row early, so a batch and its prompts alone generate as many tokens.
    config = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                           cache_implementation=cache,
                                           prefill_chunk_size=chunk, pad_token_id=0, eos_token_id=None,
                                           disable_compile=True, return_dict_in_generate=True, output_logits=True)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def same_generation(ours, eager):
    """Identical tokens, and every step's logits within 1e-4 of eager's (the tokens
    alone would miss an error too small to change an argmax)."""
    (tokens, logits), (eager_tokens, eager_logits) = ours, eager
    assert torch.equal(tokens, eager_tokens), (tokens, eager_tokens)
    assert max_rel(logits, eager_logits) < 1e-4


@pytest.mark.parametrize("name", _models(*QUICK))
def test_prefill_logits_match_eager(name):
    """A batch of two 20-token prompts (past the window of 8) in float32."""
    model = build(name)
    ids = prompt(20, 1, batch=2)
    ours = run(model, "swa_tvm", lambda: model(input_ids=ids).logits)
    eager = run(model, "eager", lambda: model(input_ids=ids).logits)
    assert max_rel(ours, eager) < 1e-4
    # Left-padded (the KV-cache kernels, padding slots excluded): the real tokens' logits.
    mask = (torch.arange(20)[None, :] >= torch.tensor([[0], [6]])).long()
    ours = run(model, "swa_tvm", lambda: model(input_ids=ids, attention_mask=mask).logits)
    eager = run(model, "eager", lambda: model(input_ids=ids, attention_mask=mask).logits)
    assert max_rel(ours[mask.bool()], eager[mask.bool()]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name,option,plain", [("gemma2", "attn_logit_softcapping", None),
                                               ("gemma2", "query_pre_attn_scalar", 16),
                                               ("gemma3", "query_pre_attn_scalar", 16)])
def test_the_options_matter(name, option, plain):
    """The options passed through (softcap, scaling; the sinks in the training test) change
    eager's logits far beyond the tests' tolerance, so the tests above see them."""
    ids = prompt(20, 1, batch=2)
    logits = [run(m, "eager", lambda m=m: m(input_ids=ids).logits) for m in (build(name), build(name, **{option: plain}))]
    assert max_rel(logits[1], logits[0]) > 1e-2


@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", _models(*QUICK))
def test_generate_matches_eager(name, cache):
    """32 greedy tokens after a 12-token prompt (44 positions: the sliding layers' cache
    rolls, or shifts in the static cache) are eager's tokens."""
    model = build(name)
    ids = prompt(12, 2)
    impl_cache = None if cache == "dynamic" else "static"
    ours = run(model, "swa_tvm", lambda: greedy(model, ids, cache=impl_cache))
    eager = run(model, "eager", lambda: greedy(model, ids, cache=impl_cache))
    same_generation(ours, eager)


@pytest.mark.parametrize("cache", [None, pytest.param("static", marks=pytest.mark.slow)], ids=["dynamic", "static"])
@pytest.mark.parametrize("name", _models(*QUICK))
def test_left_padded_batch_matches_each_prompt_alone(name, cache):
    """Prompts of 13 and 6 tokens, the short one left-padded in one batch: each row
    generates what its prompt generates alone, and what eager generates for the batch."""
    model = build(name)
    long, short = prompt(13, 3), prompt(6, 4)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 7, dtype=torch.long), short], dim=1)])
    mask = (torch.arange(13)[None, :] >= torch.tensor([[0], [7]])).long()
    batch = run(model, "swa_tvm", lambda: greedy(model, ids, mask, new=16, cache=cache))
    alone = [run(model, "swa_tvm", lambda p=p: greedy(model, p, new=16, cache=cache)) for p in (long, short)]
    eager = run(model, "eager", lambda: greedy(model, ids, mask, new=16, cache=cache))
    same_generation(batch, (torch.cat([a[0] for a in alone]), torch.cat([a[1] for a in alone])))
    same_generation(batch, eager)


@pytest.mark.slow
@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic", "static"])
@pytest.mark.parametrize("name", _models())
def test_chunked_prefill(name, cache):
    """A 19-token left-padded batch prefilled in chunks of 5 (queries against a cache
    that already holds keys, in the sliding layers a rolled one) generates eager's
    tokens without chunks."""
    model = build(name)
    ids = torch.cat([prompt(19, 5), torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt(15, 6)], dim=1)])
    mask = (torch.arange(19)[None, :] >= torch.tensor([[0], [4]])).long()
    ours = run(model, "swa_tvm", lambda: greedy(model, ids, mask, new=12, cache=cache, chunk=5))
    eager = run(model, "eager", lambda: greedy(model, ids, mask, new=12, cache=cache))
    same_generation(ours, eager)


@pytest.mark.parametrize("name", _models(*QUICK))
def test_bfloat16_within_eager_error(name):
    """In bfloat16, the logits are as close to float32 eager's as eager's own bfloat16
    logits are (within 1.5 times their error)."""
    model = build(name)
    ids = prompt(20, 7, batch=2)
    exact = run(model, "eager", lambda: model(input_ids=ids).logits)
    model = model.to(torch.bfloat16)
    eager = run(model, "eager", lambda: model(input_ids=ids).logits)
    ours = run(model, "swa_tvm", lambda: model(input_ids=ids).logits)
    assert ours.dtype == torch.bfloat16
    assert max_rel(ours, exact) <= 1.5 * max_rel(eager, exact), (max_rel(ours, exact), max_rel(eager, exact))


@pytest.mark.slow
def test_gemma3_bidirectional_layers():
    """Gemma 3's bidirectional variant (its config stores W // 2 + 1 and its sliding
    layers see |i - j| < that; its full layers see every position) on a left-padded
    batch: eager's hidden states on every real token."""
    config = transformers.Gemma3TextConfig(**COMMON, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                           use_bidirectional_attention=True,
                                           layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(config).eval()
    ids = torch.cat([prompt(16, 8), torch.cat([torch.zeros(1, 5, dtype=torch.long), prompt(11, 9)], dim=1)])
    mask = (torch.arange(16)[None, :] >= torch.tensor([[0], [5]])).long()
    ours = run(model, "swa_tvm", lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state)
    eager = run(model, "eager", lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state)
    real = mask.bool()
    assert max_rel(ours[real], eager[real]) < 1e-4


@pytest.mark.parametrize("padded", [False, True], ids=["whole", "left_padded"])
@pytest.mark.parametrize("name", _models("gpt_oss"))
def test_training_gradients_match_eager(name, padded):
    """A training step's loss and every parameter's gradient (the sinks' included) are
    eager's: on whole sequences (the full-sequence kernels) and on a left-padded batch
    (the KV-cache kernels' gradients)."""
    model = build(name).train()
    ids = prompt(20, 10, batch=2)
    pad = 7 if padded else 0
    mask = (torch.arange(20)[None, :] >= torch.tensor([[0], [pad]])).long()
    # No loss on the pads, nor on the first real token: a pad row predicts it, and a pad
    # row sees no key (swa_tvm: 0; eager: an average over masked keys).
    labels = ids.masked_fill(torch.arange(20)[None, :] <= torch.tensor([[-1], [pad]]), -100)
    grads = {}
    for impl in ("swa_tvm", "eager"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[impl] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (loss, ours), (eager_loss, eager) = grads["swa_tvm"], grads["eager"]
    assert torch.allclose(loss, eager_loss, rtol=1e-5)
    assert set(ours) == set(eager) and any("sinks" in n for n in ours) == (name == "gpt_oss")
    if name == "gpt_oss":  # the learned sinks change the loss
        for layer in model.model.layers:
            torch.nn.init.zeros_(layer.self_attn.sinks)
        with torch.no_grad():
            assert abs(model(input_ids=ids, attention_mask=mask, labels=labels).loss - eager_loss) > 1e-3
    for n in eager:
        err = ((ours[n] - eager[n]).norm() / eager[n].norm().clamp_min(1e-30)).item()
        assert err < 1e-4, (n, err)


def test_packed_sequences_are_refused_by_name():
    """Packed sequences (position_ids restarting, no cache) make transformers' mask
    a block diagonal, not a window: a ValueError saying so, not a wrong answer."""
    model = build("mistral")
    pid = torch.cat([torch.arange(10), torch.arange(10)])[None]
    with pytest.raises(ValueError, match="not a window swa_tvm serves"):
        run(model, "swa_tvm", lambda: model(input_ids=prompt(20, 11), position_ids=pid, use_cache=False))


def test_bad_use_is_named():
    """A name transformers would route elsewhere, a mask that is not the integration's,
    and attention dropout each get an error naming the argument."""
    with pytest.raises(ValueError, match="name"):
        swa_hf.register("my_sdpa")
    with pytest.raises(TypeError, match="name"):
        swa_hf.register(3)
    model = build("mistral")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16)
    k = v = torch.randn(1, 2, 5, 16)
    with pytest.raises(TypeError, match="attention_mask"):
        swa_hf.attention(attn, q, k, v, torch.ones(1, 1, 5, 5, dtype=torch.bool))
    mask = swa_hf.slot_positions(1, 5, 5, mask_function=transformers.masking_utils.causal_mask_function)
    with pytest.raises(ValueError, match="dropout"):
        swa_hf.attention(attn, q, k, v, mask, dropout=0.1)
    with pytest.raises(ValueError, match="attention_mask was built for"):
        swa_hf.attention(attn, q, k[:, :, :4], v[:, :, :4], mask)


def test_register_stops_tvm_workers_spinning_unless_chosen(monkeypatch):
    """register() sets TVM's pool to not spin after a kernel (it would take the cores of
    the model's torch ops), and keeps a count the user chose."""
    monkeypatch.delenv("TVM_THREAD_POOL_SPIN_COUNT", raising=False)
    swa_hf.register()
    assert os.environ["TVM_THREAD_POOL_SPIN_COUNT"] == "0"
    monkeypatch.setenv("TVM_THREAD_POOL_SPIN_COUNT", "1000")
    swa_hf.register()
    assert os.environ["TVM_THREAD_POOL_SPIN_COUNT"] == "1000"
