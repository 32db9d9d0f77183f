"""Tokenizer: ``tokenizers.Tokenizer`` plus the checkpoint's special tokens and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog
import tokenizers
from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ._errors import ModelLoadError, ModelNotFoundError

log = structlog.get_logger(__name__)


class Tokenizer:
    """Encode/decode plus ``eos_token_ids``, ``bos_token_id`` and ``apply_chat_template``."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.backend = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>"}
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, directory: str | Path, *, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja from a checkpoint."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelNotFoundError(f"{path} not found: the checkpoint needs a tokenizers tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config = _read_json(directory / "tokenizer_config.json")
        texts = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        special = {k: v for k, v in texts.items() if v is not None}
        eos = set(extra_eos_token_ids)
        eos_id = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if eos_id is not None:
            eos.add(eos_id)
        bos = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        return cls(
            backend,
            eos_token_ids=eos,
            bos_token_id=bos,
            chat_template=_chat_template(directory, config),
            special_tokens=special,
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """text -> ids (special tokens written in ``text`` are always recognised).

        Raises ValueError for text that is not a str of valid Unicode (a lone surrogate
        such as "\\ud800" cannot be encoded as UTF-8)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text is not valid Unicode: {exc.reason} at index {exc.start} "
                             f"({text[exc.start:exc.end]!r})") from None
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the checkpoint's jinja chat template (as transformers does) to a prompt string."""
        if self._template is None:
            raise ModelLoadError("this tokenizer has no chat_template (tokenizer_config.json)")
        context = {**self.special_tokens, **kwargs}
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **context
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """Chat-templated prompt ids (the template writes its own special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _compile_template(source: str) -> Template:
    # Same environment options as transformers' apply_chat_template.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: take "default"
        by_name = {t["name"]: t["template"] for t in template}
        template = by_name.get("default", next(iter(by_name.values()), None))
    return template
