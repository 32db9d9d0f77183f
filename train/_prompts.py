"""Chat prompts from corpora that install offline, in several forms.

Training sources: WordNet nouns and verbs (Debian ``wordnet-base``), Debian package
summaries (``apt-cache dumpavail``) and Python standard-library docstrings. The
held-out split comes from another source: Debian ``fortunes``. Each builder is
deterministic (sorted input, seeded choice of template), so a rebuild gives the same set.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import subprocess
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import attrs

WORDNET = Path("/usr/share/wordnet")
FORTUNES = Path("/usr/share/games/fortunes")
# The demo's prompt must stay unseen.
EXCLUDED_TOPICS = frozenset({"llama", "llamas"})

SOURCES = {
    "wordnet": "WordNet 3.0 (Debian wordnet-base), WordNet 3.0 licence (BSD-style, Princeton)",
    "debian-descriptions": "Debian package descriptions (apt-cache dumpavail), each under "
                           "its package's DFSG-free licence",
    "python-docstrings": "Python standard-library docstrings, PSF-2.0",
    "fortunes": "Debian fortunes (fortune-mod data), BSD-style licence; held-out only",
}


@attrs.frozen
class Prompt:
    text: str
    source: str
    form: str       # question, instruction, code, rewrite, ...


NOUN_FORMS = [("question", "Tell me about {w}."), ("question", "What is {a} {w}?"),
              ("instruction", "Give me three interesting facts about {w}."),
              ("instruction", "Explain {w} to a ten-year-old."),
              ("instruction", "Write a short poem about {w}."),
              ("question", "Why does {w} matter? Answer in a short paragraph."),
              ("rewrite", "Rewrite this definition in plain words: {w} is {gloss}.")]
# Open-chat forms (stories, opinions, letters, dialogue, how-to), added to the noun forms
# for training sets over 6,000 prompts: chat users ask for such answers (the held-out split
# does too, from another source: fortunes).
OPEN_FORMS = [("instruction", "Write a short story about {a} {w}."),
              ("question", "What are the advantages and disadvantages of {w}?"),
              ("instruction", "Describe {w} in a few sentences."),
              ("instruction", "Write a short, polite email to a colleague about {w}."),
              ("question", "What is your opinion of {w}? Explain your reasoning."),
              ("instruction", "Write a dialogue between two friends who disagree about {w}."),
              ("instruction", "Explain step by step how {w} works.")]
VERB_FORMS = [("question", "What does it mean to {w}?"),
              ("instruction", "Write two example sentences using the verb \"{w}\"."),
              ("question", "How do people usually {w}? Explain briefly.")]
PKG_FORMS = [("question", "What is the {pkg} software package for? Its summary: {short}."),
             ("rewrite", "Rewrite this package summary as a full sentence: {pkg} - {short}"),
             ("instruction", "Explain in a few sentences what \"{short}\" means."),
             ("instruction", "Write a short announcement for a new release of {pkg} ({short})."),
             ("question", "When would I use {pkg}? It is described as: {short}.")]
DOC_FORMS = [("code", "Explain what the Python function `{name}{sig}` does."),
             ("code", "Write a short Python example that uses `{name}`."),
             ("rewrite", "Rewrite this Python docstring to be clearer:\n\n{doc}"),
             ("code", "What does `{name}` return? Its documentation says: {first}")]
FORTUNE_FORMS = [("question", "What does this saying mean?\n\n{text}"),
                 ("rewrite", "Rewrite this in formal English:\n\n{text}"),
                 ("instruction", "Write a short story inspired by this quote:\n\n{text}"),
                 ("question", "Do you agree with this? Why or why not?\n\n{text}")]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _wordnet_index(pos: str, min_tagged: int) -> Iterator[tuple[str, int]]:
    for line in (WORDNET / f"index.{pos}").read_text(errors="replace").splitlines():
        if line.startswith(" "):
            continue
        f = line.split()
        p_cnt = int(f[3])
        tagged = int(f[5 + p_cnt])
        lemma = f[0].replace("_", " ")
        if tagged >= min_tagged and lemma.isascii() and lemma.replace(" ", "").isalpha():
            yield lemma, int(f[6 + p_cnt])            # first (most frequent) synset


def _glosses(pos: str) -> dict[int, str]:
    out = {}
    for line in (WORDNET / f"data.{pos}").read_text(errors="replace").splitlines():
        if line[:1].isdigit() and "|" in line:
            out[int(line.split()[0])] = line.split("|", 1)[1].split(";")[0].strip()
    return out


def wordnet_prompts(rng: random.Random, min_tagged_nouns: int = 2,
                    noun_forms: Sequence[tuple[str, str]] = tuple(NOUN_FORMS)) -> list[Prompt]:
    prompts = []
    glosses = _glosses("noun")
    for lemma, offset in _wordnet_index("noun", min_tagged_nouns):
        if lemma in EXCLUDED_TOPICS:
            continue
        form, tpl = rng.choice(noun_forms)
        text = tpl.format(w=lemma, a=_article(lemma), gloss=glosses.get(offset, lemma))
        prompts.append(Prompt(text, "wordnet", form))
    for lemma, _ in _wordnet_index("verb", 3):
        form, tpl = rng.choice(VERB_FORMS)
        prompts.append(Prompt(tpl.format(w=lemma), "wordnet", form))
    return prompts


def _debian_records() -> Iterator[dict[str, str]]:
    out = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True,
                         check=True).stdout
    for block in out.split("\n\n"):
        rec, key = {}, None
        for line in block.splitlines():
            if line.startswith(" ") and key:
                rec[key] += "\n" + line[1:]
            elif ":" in line:
                key, _, value = line.partition(":")
                rec[key] = value.strip()
        if "Package" in rec and "Description" in rec:
            yield rec


def debian_prompts(rng: random.Random, limit: int) -> list[Prompt]:
    seen, prompts = set(), []
    for rec in sorted(_debian_records(), key=lambda r: r["Package"]):
        pkg = rec["Package"]
        short = rec["Description"].partition("\n")[0].strip()
        # Library splits (-dev, -doc, lib*) repeat one summary: keep distinct ones.
        if short in seen or len(short) < 15 or pkg.endswith(("-dev", "-doc", "-dbg")):
            continue
        seen.add(short)
        form, tpl = rng.choice(PKG_FORMS)
        prompts.append(Prompt(tpl.format(pkg=pkg, short=short), "debian-descriptions", form))
    rng.shuffle(prompts)
    return prompts[:limit]


STDLIB = ("os", "os.path", "sys", "json", "re", "math", "statistics", "random", "itertools",
          "functools", "collections", "string", "textwrap", "datetime", "time", "pathlib",
          "shutil", "subprocess", "csv", "sqlite3", "heapq", "bisect", "hashlib", "base64",
          "urllib.parse", "difflib", "fractions", "decimal", "operator", "copy", "glob",
          "fnmatch", "tempfile", "zipfile", "tarfile", "gzip", "argparse", "logging",
          "unicodedata", "calendar", "uuid", "secrets", "socket", "email.utils", "html",
          "xml.etree.ElementTree", "asyncio", "threading", "queue", "contextlib", "typing",
          "dataclasses", "enum", "inspect", "pprint", "shlex", "struct", "zlib", "io")


def docstring_prompts(rng: random.Random) -> list[Prompt]:
    prompts = []
    for mod_name in STDLIB:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj) or ""
            if len(doc) < 40 or getattr(obj, "__module__", mod_name) not in (mod_name, None):
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "(...)"
            form, tpl = rng.choice(DOC_FORMS)
            prompts.append(Prompt(tpl.format(name=f"{mod_name}.{name}", sig=sig,
                                             doc=doc[:700], first=doc.split("\n")[0]),
                                  "python-docstrings", form))
    return prompts


def _fortune_texts() -> Iterator[str]:
    """The fortunes a held-out prompt may quote, in file order (30-400 characters)."""
    for path in sorted(FORTUNES.iterdir()):
        if path.suffix or path.is_dir() or path.name in ("ascii-art", "art"):
            continue
        for text in path.read_text(errors="replace").split("\n%\n"):
            text = text.strip()
            if 30 <= len(text) <= 400:
                yield text


def fortune_prompts(rng: random.Random) -> list[Prompt]:
    prompts = []
    for text in _fortune_texts():
        form, tpl = rng.choice(FORTUNE_FORMS)
        prompts.append(Prompt(tpl.format(text=text), "fortunes", form))
    return prompts


def fortune_prompt_forms() -> set[tuple[str, str]]:
    """Every (text, form) ``fortune_prompts`` can make from the installed fortunes, in any
    random stream: what a held-out prompt drawn from them must be."""
    return {(tpl.format(text=text), form) for text in _fortune_texts()
            for form, tpl in FORTUNE_FORMS}


def _train_prompts(rng: random.Random, num_train: int, nouns: int,
                   noun_forms: Sequence[tuple[str, str]]) -> list[Prompt]:
    builders: list[Callable[[], list[Prompt]]] = [
        lambda: wordnet_prompts(rng, nouns, noun_forms), lambda: docstring_prompts(rng),
        lambda: debian_prompts(rng, max(num_train // 3, 1))]
    train = _distinct(p for build in builders for p in build())
    rng.shuffle(train)
    return train


def build_prompts(num_train: int, num_eval: int, seed: int) -> dict[str, list[Prompt]]:
    """{"train": [...], "eval": [...]}: distinct prompts; eval from a source train lacks.

    Up to 6,000 training prompts: nouns WordNet tags at least twice, the first seven noun
    forms. More: every tagged noun and the open-chat forms too, drawn from their own
    random stream, so the held-out split stays the one the smaller sets have."""
    rng = random.Random(seed)
    train = _train_prompts(rng, num_train, 2, tuple(NOUN_FORMS))
    held = _distinct(fortune_prompts(rng))
    rng.shuffle(held)
    if num_train > 6000:
        train = _train_prompts(random.Random(seed + 1), num_train, 1,
                               tuple(NOUN_FORMS + OPEN_FORMS))
    if len(train) < num_train:
        raise ValueError(f"only {len(train)} distinct training prompts, {num_train} asked")
    return {"train": train[:num_train], "eval": held[:num_eval]}


def _distinct(prompts: Iterable[Prompt]) -> list[Prompt]:
    seen, out = set(), []
    for p in prompts:
        if p.text not in seen:
            seen.add(p.text)
            out.append(p)
    return out


def write_prompts(path: Path, splits: dict[str, list[Prompt]]) -> None:
    with open(path, "w") as f:
        for split, prompts in splits.items():
            for p in prompts:
                f.write(json.dumps({"split": split, **attrs.asdict(p)}) + "\n")


def read_prompts(path: Path) -> dict[str, list[Prompt]]:
    splits: dict[str, list[Prompt]] = {"train": [], "eval": []}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        splits[rec.pop("split")].append(Prompt(**rec))
    return splits


def source_counts(splits: dict[str, list[Prompt]]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for split, prompts in splits.items():
        for p in prompts:
            key = f"{split}:{p.source}"
            counts.setdefault(key, {}).setdefault(p.form, 0)
            counts[key][p.form] += 1
    return counts
