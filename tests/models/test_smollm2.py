"""SmolLM2-135M-Instruct (converted once from its GGUF) against transformers, fp32."""

import pytest
import torch

from specloop.models import IncrementalDetokenizer

from ..smollm2 import NEW_TOKENS, PROMPTS

# The first test also converts the GGUF (once per cache) and computes the shared reference.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def greedy_decode(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt prefilled into its own slot, then all rows decoded together, one token
    per step at their own positions, through the KV cache; no speculation."""
    cache = model.make_cache(num_slots=len(prompts), max_seq_len=256)
    outs = []
    for slot, ids in enumerate(prompts):
        hidden = model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([slot]), cache)
        outs.append([int(model.logits(hidden[:, -1]).argmax(-1))])
    slots = torch.arange(len(prompts))
    for step in range(n - 1):
        # Row i feeds its last token at position len(prompt_i) + step: [B, 1].
        positions = torch.tensor([len(ids) + step for ids in prompts])
        hidden = model(torch.tensor([[o[-1]] for o in outs]), positions, slots, cache)
        for out, token in zip(outs, model.logits(hidden[:, -1]).argmax(-1).tolist()):
            out.append(token)
    return outs


def test_converted_checkpoint(smollm2):
    args = smollm2.args
    assert (args.num_layers, args.hidden_size, args.vocab_size) == (30, 576, 49152)
    assert args.tie_word_embeddings and args.num_kv_heads == 3
    assert smollm2.tokenizer.token_to_id("<|im_end|>") in smollm2.tokenizer.eos_token_ids


def test_greedy_equals_transformers_generate(smollm2, smollm2_reference):
    # The reference is the session's (transformers, the prompts left-padded and masked);
    # ours decodes the five prompts as one batch of rows at different positions, no
    # padding, as the engine does.
    tok = smollm2.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = greedy_decode(smollm2.model, prompts, NEW_TOKENS)
    for prompt, mine, ref in zip(PROMPTS, ours, smollm2_reference, strict=True):
        assert len(ref) == NEW_TOKENS
        assert mine == ref, prompt


def test_prefill_logits_close(smollm2, smollm2_hf):
    ids = smollm2.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits
    model = smollm2.model
    ours = model.logits(model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), model.make_cache(1, 128)))
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)


def test_chat_template_equals_transformers(smollm2, smollm2_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    tok = smollm2.tokenizer
    for messages in conversations:
        for gen in (True, False):
            ref = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == ref
        text = tok.apply_chat_template(messages)
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


def test_tokenizer_round_trip_and_streaming(smollm2):
    tok = smollm2.tokenizer
    text = "Llamas (🦙) live in the Andes — “high” places: 日本語, café, naïve."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
