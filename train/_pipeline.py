"""The whole recipe, stage by stage, each stage's output kept in the run directory so a
rerun resumes: prompts -> self-distilled answers -> trained head -> exported head + card."""

from __future__ import annotations

import datetime
import json
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from safetensors.torch import save_file

from specloop.models import load_model
from specloop.models._registry import sha256_of as file_sha256
from specloop.models.drafters._heads import target_shape

from ._distill import distill, encode_prompts, load_sequences, save_sequences
from ._evaluate import engine_acceptance, offline_acceptance
from ._prompts import SOURCES, build_prompts, read_prompts, source_counts, write_prompts
from ._trainer import train

if TYPE_CHECKING:
    from specloop.models import LoadedModel, ModelArgs

    from ._config import TrainConfig
    from ._distill import Sequence as Answer
    from ._mtp_head import TrainableMtpHead
    from ._prompts import Prompt

log = structlog.get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def stage_prompts(cfg: TrainConfig, out: Path) -> dict[str, list[Prompt]]:
    path = out / "prompts.jsonl"
    if not path.is_file():
        if cfg.data.prompts_file:
            splits = read_prompts(Path(cfg.data.prompts_file))
            splits = {"train": splits["train"][:cfg.data.num_train_prompts],
                      "eval": splits["eval"][:cfg.data.num_eval_prompts]}
        else:
            splits = build_prompts(cfg.data.num_train_prompts, cfg.data.num_eval_prompts,
                                   cfg.data.seed)
        write_prompts(path, splits)
    return read_prompts(path)


def stage_distill(cfg: TrainConfig, out: Path, splits: dict[str, list[Prompt]], device: str
                  ) -> list[Answer]:
    path = out / "sequences.pt"
    if not path.is_file():
        start = time.perf_counter()
        seqs = distill(cfg, splits, device=device)
        save_sequences(path, seqs)
        (out / "distill.json").write_text(json.dumps({
            "backend": cfg.generate.backend, "seconds": round(time.perf_counter() - start, 1),
            "answer_tokens": sum(len(s.tokens) - s.prompt_len for s in seqs)}) + "\n")
    return load_sequences(path)


def export_head(head: TrainableMtpHead, cfg: TrainConfig, path: Path, args: ModelArgs
                ) -> None:
    """bf16 float weights + int64 d2t, target shape in the safetensors metadata."""
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous().cpu()
               for k, v in head.export_state().items()}
    meta = {f"target_{k}": str(v) for k, v in target_shape(args).items()}
    meta.update(method=cfg.head.method, draft_vocab_size=str(int(head.d2t.numel())),
                target_model=cfg.target.model)
    if head.feature_layers:
        meta["feature_layers"] = ",".join(map(str, head.feature_layers))
    save_file(tensors, str(path), metadata=meta)


def evaluate(cfg: TrainConfig, loaded: LoadedModel, head: TrainableMtpHead, seqs: list[Answer],
             splits: dict[str, list[Prompt]], head_path: Path, device: str
             ) -> dict[str, Any]:
    k = cfg.eval.k
    held = [s for s in seqs if s.split == "eval"]
    # Over the engine's window of answer tokens too: walk_k<K> is what engine_greedy_k<K>
    # should measure (up to the prompts: the engine runs the first engine_prompts of them).
    result = {"offline_greedy": offline_acceptance(head, loaded.model, held, k, device,
                                                   window=cfg.eval.engine_max_tokens,
                                                   walk_ks=(3,))}
    n = cfg.eval.engine_prompts
    if n <= 0:
        return result
    ids = encode_prompts(loaded.tokenizer, splits["eval"][:n],
                         cfg.generate.max_seq_len - cfg.eval.engine_max_tokens - k - 2)
    common: dict[str, Any] = dict(max_tokens=cfg.eval.engine_max_tokens, device=device,
                  dtype=cfg.target.dtype, seed=cfg.data.seed)
    m, runs = cfg.head.method, {}
    for kk in sorted({3, k}):
        for temp, label in ((0.0, "greedy"), (0.7, "t0.7")):
            runs[f"engine_{label}_k{kk}"] = ({"method": m, "num_draft_tokens": kk,
                                              "draft_weights": str(head_path)}, temp, 1.0)
            if cfg.eval.ngram:
                runs[f"engine_ngram_{label}_k{kk}"] = (
                    {"method": "ngram", "num_draft_tokens": kk}, temp, 1.0)
    for name, (spec, temp, top_p) in runs.items():
        start = time.perf_counter()
        result[name] = engine_acceptance(loaded, cfg.target.model, ids, spec,
                                         temperature=temp, top_p=top_p, **common)
        log.info("evaluated", run=name, al=result[name]["al"],
                 seconds=round(time.perf_counter() - start, 1))
    return result


def vocab_coverage(d2t: torch.Tensor, seqs: list[Answer], vocab_size: int) -> float | None:
    """Share of the held-out greedy answers' tokens inside the draft vocabulary (a draft
    chain cannot get past a token outside it)."""
    tokens = [t for s in seqs if s.mode == "greedy" for t in s.tokens[s.prompt_len:]]
    if not tokens:
        return None
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[d2t.cpu()] = True
    return round(float(inside[torch.tensor(tokens)].float().mean()), 4)


def write_card(cfg: TrainConfig, path: Path, head_path: Path, *, args: ModelArgs,
               splits: dict[str, list[Prompt]], seqs: list[Answer], summary: dict[str, Any],
               evals: dict[str, Any], command: str, device: str,
               coverage: float | None = None) -> dict[str, Any]:
    answers = [len(s.tokens) - s.prompt_len for s in seqs]
    card = {
        "name": cfg.output.name, "method": cfg.head.method, "format": "safetensors, bf16",
        "file": head_path.name, "sha256": file_sha256(head_path),
        "target": {"model": cfg.target.model, **target_shape(args)},
        "draft_vocab_size": cfg.head.draft_vocab_size,
        "draft_vocab_coverage_held_out": coverage, "ttt_steps": cfg.head.ttt_steps,
        "step_decay": cfg.head.step_decay, "loss": "forward KL (soft cross-entropy) "
        "against the target's softmax over the draft vocabulary",
        "data": {"sources": SOURCES, "prompts": source_counts(splits),
                 "sequences": {split: sum(s.split == split for s in seqs)
                               for split in ("train", "eval")},
                 "greedy_sequences": sum(s.mode == "greedy" for s in seqs),
                 "answer_tokens": sum(answers),
                 "answers": f"regenerated by the target ({cfg.generate.backend} backend, "
                            f"greedy and T={cfg.generate.temperature}, "
                            f"{cfg.generate.answers_per_prompt} per training prompt)",
                 "distillation": _read_json(head_path.parent / "distill.json")},
        "training": summary, "evaluation_held_out": evals,
        "command": command, "config": cfg.to_dict(), "device": device,
        "host": platform.node(), "torch": torch.__version__,
        "specloop": _version(), "created": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds")}
    path.write_text(json.dumps(card, indent=1) + "\n")
    return card


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _version() -> str:
    try:
        return version("specloop")
    except PackageNotFoundError:
        return "unknown"


def run(cfg: TrainConfig, *, command: str, out_dir: str | None = None,
        device: str | None = None) -> dict[str, Any]:
    out = Path(out_dir or cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(device or cfg.target.device)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    splits = stage_prompts(cfg, out)
    seqs = stage_distill(cfg, out, splits, device)
    loaded = load_model(cfg.target.model, dtype=DTYPES[cfg.target.dtype], device=device)
    head, summary = train(cfg, loaded.model, seqs, out, device)
    head_path = out / f"{cfg.output.name}.safetensors"
    export_head(head, cfg, head_path, loaded.args)
    evals = evaluate(cfg, loaded, head, seqs, splits, head_path, device)
    coverage = vocab_coverage(head.d2t, [s for s in seqs if s.split == "eval"],
                              loaded.args.vocab_size)
    return write_card(cfg, out / f"{cfg.output.name}.json", head_path, args=loaded.args,
                      splits=splits, seqs=seqs, summary=summary, evals=evals,
                      command=command, device=device, coverage=coverage)
