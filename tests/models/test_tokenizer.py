import random

import pytest

from specloop.models import IncrementalDetokenizer, Tokenizer

TEXTS = ["Hello, world!", "café naïve 日本語 🦙 emoji", "def f(x):\n    return x * 2\n", ""]


@pytest.fixture(scope="module")
def tok(tiny_dirs) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dirs["llama"])


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens(tok):
    assert tok.vocab_size == 512
    assert tok.bos_token_id == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    ids = tok.encode("<|im_start|>user", add_special_tokens=False)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user"
    assert tok.decode(ids) == "user"


@pytest.mark.xdist_group("smollm2")    # with test_decoder_vs_transformers: one import
def test_chat_template_matches_transformers(tok, tiny_dirs):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert tok.encode_chat(messages) == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def _stream(tok, ids, chunk_sizes):
    detok, deltas, i = IncrementalDetokenizer(tok), [], 0
    for size in chunk_sizes:
        deltas.append(detok.push(ids[i : i + size]))
        i += size
    deltas.append(detok.push(ids[i:]))
    deltas.append(detok.flush())
    return deltas


def test_incremental_detokenizer_multibyte(tok):
    text = "naïve café → 日本語の文章 🦙🦙 done"
    ids = tok.encode(text)
    assert len(ids) > len(text) // 2  # many byte-level tokens: characters are split
    deltas = _stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    rng = random.Random(0)
    for _ in range(5):
        sizes = [rng.randint(1, 4) for _ in range(len(ids) // 2)]
        assert "".join(_stream(tok, ids, sizes)) == text


def test_detokenizer_flush_emits_incomplete_tail(tok):
    ids = tok.encode("🦙")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == ""  # incomplete UTF-8 sequence is held back
    assert detok.flush().endswith("\ufffd")


class _RefusingStream:
    """A DecodeStream that fails on its n-th token (as a refused prefix does)."""

    def __init__(self, inner, n):
        self.inner, self.n = inner, n

    def step(self, backend, token):
        self.n -= 1
        if self.n < 0:
            raise ValueError("invalid prefix")
        return self.inner.step(backend, token)


@pytest.mark.parametrize("path", ["stream", "window", "stream_fails"])
def test_detokenizer_any_ids_any_chunking_equals_full_decode(tok, path):
    """Random ids (special tokens, stray UTF-8 bytes included) in random chunks: the
    deltas concatenate to the one-shot decode, through the Rust stream, the window
    algorithm, and a stream that fails mid-way and hands over to the window."""
    from specloop.models import _detokenizer
    if path != "window" and _detokenizer.DecodeStream is None:
        pytest.skip("tokenizers has no DecodeStream")
    rng = random.Random(1)
    for _ in range(400):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 16))]
        detok, out, i = IncrementalDetokenizer(tok), [], 0
        if path == "window":
            detok._stream = None
        elif path == "stream_fails":
            detok._stream = _RefusingStream(detok._stream, rng.randrange(len(ids)))
        while i < len(ids):
            size = rng.randint(1, 4)
            out.append(detok.push(ids[i:i + size]))
            i += size
        out.append(detok.flush())
        assert "".join(out) == tok.decode(ids), ids
