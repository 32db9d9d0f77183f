"""The target model's compute on one rank: KV cache, prefill and the verify forward.

Everything here is synchronous tensor work; the state machine runs it off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import numpy
import structlog
import torch

from specloop.graphs import GraphCache, GraphKey, SamplingPath, Step, Tensors
from specloop.graphs._cache import captured_inputs
from specloop.models import KVCache, LoadedModel, PageTable, TreeMask
from specloop.models._prefill import padded_shape, prefill_shapes
from specloop.models._grad import inference_mode
from specloop.models._host import StagingRing, current_stream, to_device

from ._request import Request

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "float64": torch.float64}


def resolve_device(name: str, rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and torch.cuda.is_available():
        # One GPU per rank when a rank does not name its own.
        name = f"cuda:{rank % torch.cuda.device_count()}"
    return torch.device(name)


def prefill_key(rows: int, width: int, stage: str = "prefill") -> GraphKey:
    """The graph key of a padded prefill shape (stage "prefill", the target's, or
    "draft-prefill", the drafter's; ``tokens`` its width)."""
    return GraphKey(rows, 0, SamplingPath.GREEDY, True, stage=stage, tokens=width)


@attrs.frozen
class ReadBack:
    """A queued device-to-host copy: ``host`` is valid once ``done`` (None: already)."""

    host: torch.Tensor
    done: torch.cuda.Event | None


class ModelRunner:
    """Owns the target model, its paged KV cache (one slot per batch row) and the page
    table every cache of the engine shares: a request owns the pages its length needs."""

    def __init__(self, loaded: LoadedModel, *, num_slots: int, max_seq_len: int,
                 max_prefill_tokens: int, page_size: int = 16) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.args = loaded.args
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        # Pages kept past the committed K/V at a trim: 1 while a step queued ahead
        # writes the next position (the worker sets it; see engine/_ahead.py).
        self.keep_ahead = 0
        self.pages = PageTable(num_slots, max_seq_len, page_size, device=self.device)
        self.cache = KVCache(loaded.args, num_slots, max_seq_len, dtype=self.dtype,
                             device=self.device, pages=self.pages)
        # Layers whose residual streams the drafter reads instead of the final hidden
        # state (an EAGLE-3 head's low/mid/high features); () = the final hidden state.
        self.feature_layers: tuple[int, ...] = ()
        # Requests admitted together share prefill forwards (``prefill_many``): on a GPU
        # an eager forward costs ~10 ms of kernel launches whatever its rows (issue 12).
        # The CPU is compute-bound, so it keeps one forward per request (same numerics).
        self.batch_prefill = self.device.type == "cuda"
        # Prefill forwards at padded shapes (``padded_shape``), graphs' or eager: on a GPU
        # with the fused kernels (they put positions past max_seq_len in the scratch page
        # and read lengths on the device; on the CPU padding would only add work; tests
        # set it).
        self.pad_prefill = self.device.type == "cuda" and bool(
            getattr(self.model, "uses_kernels", False))
        # The graph cache holding the prefill graphs (``prefill_graphs``), set at warm-up.
        self.prefill_cache: GraphCache | None = None
        # Pinned host buffers for a graphed prefill's inputs (``_prefill_rows``).
        self._prefill_staging = StagingRing(self.device, torch.int64)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, slots: torch.Tensor,
                *, kv_len: int | None = None, tree: TreeMask | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final hidden [B, T, H] for the logits, what the drafter reads: the same
        tensor, or the feature layers concatenated [B, T, F*H]; no extra work without).
        ``tree``: the rows are a draft tree's (models/_decoder.py ``TreeMask``)."""
        if not self.feature_layers:
            hidden: torch.Tensor = self.model(tokens, start_pos, slots, self.cache,
                                              kv_len=kv_len, tree=tree)
            return hidden, hidden
        both: tuple[torch.Tensor, torch.Tensor] = self.model(
            tokens, start_pos, slots, self.cache, kv_len=kv_len, capture=self.feature_layers,
            tree=tree)
        return both

    def read_back(self, packed: torch.Tensor) -> torch.Tensor:
        """The iteration's one device-to-host read: ``packed`` copied into pinned host
        memory, then waited for."""
        return self.finish_read_back(self.start_read_back(packed))

    def start_read_back(self, packed: torch.Tensor) -> ReadBack:
        """Queue ``read_back``'s copy; -> a handle, its data valid after
        ``finish_read_back``. Several may be in flight (a step queued ahead, issue 12):
        each has its own pinned buffer from torch's caching host allocator, which does
        not hand a buffer out again before the copy into it is done, so a handle that is
        dropped unread is safe."""
        if packed.device.type == "cpu":
            return ReadBack(packed.clone(), None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record(current_stream(packed.device.index))
        return ReadBack(host, done)

    def finish_read_back(self, pending: ReadBack) -> torch.Tensor:
        """Wait for the queued copy; -> the data (the handle's own buffer)."""
        if pending.done is not None:
            pending.done.synchronize()
        return pending.host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor's copy on this device, queued without waiting: from pinned memory
        on a GPU (a copy from pageable memory may wait for the queued work, which would
        stall the host behind a step queued ahead)."""
        return to_device(host, self.device)

    def reserve(self, requests: Iterable[Request], extra: int) -> None:
        """Pages for each request's next ``extra`` positions past its length (VERIFY and
        the drafters write up to seq_len - 1 + K), on the device before the step runs.
        Pages are only added: RESCAN's trim gives back what no step needs (the chain
        reserves 2K + 1 positions, a K = 0 step queued ahead 1, DRAFT the iteration's K:
        with a resize both ways a switch into K = 0 gave the chain's pages back, and
        while DRAFT reserved the drafter's K at K = 0, adaptive n-gram's K = 0 stretches
        took a page and gave it back in ~45 % of iterations on the CPU, each a copy of
        the table)."""
        # resize_many(shrink=False) inline, without its (slot, length) list: a row whose
        # pages already hold the positions (most rows, most iterations) costs one
        # comparison; r.slot read once (batch_slot's check only where it is None).
        pages = self.pages
        grow_at, resize = pages.grow_at, pages.resize
        for r in requests:
            slot = r.slot
            if slot is None:
                slot = r.batch_slot
            length = len(r.token_ids) + extra
            if length > grow_at[slot]:
                resize(slot, length)
        pages.sync()

    def trim(self, request: Request) -> None:
        """Give back pages past the committed K/V (drafts rejected past a page boundary)."""
        self.pages.resize(request.batch_slot, request.num_cached + self.keep_ahead)

    def trim_many(self, requests: Iterable[Request]) -> None:
        """``trim`` of each request, in order (RESCAN's rows, one call between releases)."""
        keep, pages = self.keep_ahead, self.pages
        # resize_many inline, as in reserve.
        grow_at, shrink_at, resize = pages.grow_at, pages.shrink_at, pages.resize
        for r in requests:
            slot = r.slot
            if slot is None:
                slot = r.batch_slot
            length = r.num_cached + keep
            if length > grow_at[slot] or length <= shrink_at[slot]:
                resize(slot, length)

    def release(self, slot: int) -> None:
        self.pages.release(slot)

    def prefill_many(self, requests: list[Request], headroom: int = 0
                     ) -> list[torch.Tensor]:
        """``prefill`` of each request, in order. With ``batch_prefill``, requests whose
        prompt fits one chunk share forwards of at most ``max_prefill_tokens`` tokens
        counting the padding (rows right-padded to the longest; with ``pad_prefill`` rows
        and width to ``padded_shape``); longer prompts are prefilled alone, in chunks.
        ``headroom``: each request's pages hold that many positions past its prompt too
        (what its first step reserves: the page table's copy at the prefill carries
        them, not another one a moment later)."""
        if not self.batch_prefill:
            return [self.prefill(r, headroom) for r in requests]
        out: dict[int, torch.Tensor] = {}
        group: list[tuple[int, Request, int]] = []   # (index, request, tokens to write)
        for i, request in enumerate(requests):
            n = request.seq_len - 1 - request.num_cached
            if not 0 < n <= self.max_prefill_tokens:
                out[i] = self.prefill(request, headroom)
                continue
            width = max([n] + [m for *_, m in group])
            ends = [r.num_cached + width for _, r, _ in group] + [request.num_cached + width]
            rows, padded = self._shape(len(group) + 1, width)
            if group and (rows * padded > self.max_prefill_tokens
                          or max(ends) > self.max_seq_len):
                out.update(self._prefill_rows(group, headroom))
                group = []
            group.append((i, request, n))
        if group:
            out.update(self._prefill_rows(group, headroom))
        return [out[i] for i in range(len(requests))]

    @inference_mode
    def _prefill_rows(self, group: list[tuple[int, Request, int]], headroom: int = 0
                      ) -> dict[int, torch.Tensor]:
        """One forward over [B, T] (padded to ``padded_shape``): row b writes its request's
        next n_b prompt tokens. The padding (token 0) past them writes K/V into the row's
        own pages past its length (its next steps overwrite those positions before any
        query reads them) or into the scratch page (unowned table entries point there);
        padding rows are the scratch slot's."""
        real = len(group)
        rows, width = self._shape(real, max(n for *_, n in group))
        key = prefill_key(rows, width)
        cache = self.prefill_cache      # the graph's, where captured
        if cache is not None and not cache.has(key):
            cache = None
        statics = captured_inputs(cache, key) if cache is not None else None
        # tokens [rows, width] and starts [2, rows] (positions, slots) in one host buffer,
        # written through numpy: under a server's load a prefill runs nearly every
        # iteration, and a torch.tensor of a row's ids, a second tensor and a second copy
        # cost ~60 us of the H200's host (bench/bench_host_ops_gpu.py). A graph's: a
        # pinned buffer of the staging ring copied straight into its static inputs (no
        # buffer pinned, allocated or copied again a call: at admission each CUDA call
        # took 20-150 us of the lent H100's host, bench/probe_ttft_gpu.py).
        size = rows * (width + 2)
        if statics is not None:
            ring = self._prefill_staging
            host, buffer = ring.take(size)
            host = host[:size]
            host[:] = 0
        else:
            host = numpy.zeros(size, dtype=numpy.int64)
        tokens, starts = host[:rows * width].reshape(rows, width), host[rows * width:]
        for row, (_, request, n) in enumerate(group):
            self.pages.resize(request.batch_slot, request.seq_len + headroom)
            tokens[row, :n] = request.token_ids[request.num_cached:request.num_cached + n]
            starts[row] = request.num_cached
            starts[rows + row] = request.batch_slot
        starts[rows + real:] = self.cache.scratch_slot     # padding rows: the scratch slot
        if statics is not None:
            inputs = statics
            ring.copy_into(buffer, [inputs["tokens"], inputs["starts"]])
        else:
            packed = self.to_device(torch.from_numpy(host))
            inputs = {"tokens": packed[:rows * width].view(rows, width),
                      "starts": packed[rows * width:].view(2, rows)}
        if cache is not None:
            self.pages.sync()   # an eager forward syncs the table itself
            # The graph's outputs are its own until its next replay: keep the rows.
            features = cache.replay(key, inputs)["features"][:real].clone()
        else:
            features = self.prefill_step(inputs)["features"]
        out = {}
        for row, (i, request, n) in enumerate(group):
            out[i] = features[row, :n]          # [n, H] (or [n, F*H])
            request.num_cached += n
        return out

    def _shape(self, rows: int, width: int) -> tuple[int, int]:
        return padded_shape(rows, width) if self.pad_prefill else (rows, width)

    def prefill_step(self, inputs: Tensors) -> Tensors:
        """The forward of a prefill graph: {"tokens" [R, W], "starts" [2, R] (positions,
        slots)} -> {"features": what the drafter reads, [R, W, H] or [R, W, F*H]}."""
        starts = inputs["starts"]
        return {"features": self.forward(inputs["tokens"], starts[0], starts[1])[1]}

    def prefill_graphs(self) -> list[tuple[GraphKey, Step, Tensors]]:
        """What warm-up captures for prefill on a GPU with the fused kernels (their grid
        depends on shapes only; the reference path reads lengths on the host): each
        ``prefill_shapes`` shape, on padding rows (the scratch slot)."""
        if not (self.pad_prefill and self.batch_prefill):
            return []
        out: list[tuple[GraphKey, Step, Tensors]] = []
        for rows, width in prefill_shapes(self.pages.num_slots, self.max_prefill_tokens):
            starts = torch.tensor([[0] * rows, [self.cache.scratch_slot] * rows],
                                  device=self.device)
            example = {"tokens": torch.zeros(rows, width, dtype=torch.int64,
                                             device=self.device), "starts": starts}
            out.append((prefill_key(rows, width), self.prefill_step, example))
        return out

    @inference_mode
    def prefill(self, request: Request, headroom: int = 0) -> torch.Tensor:
        """Write K/V for every token but the last (VERIFY forwards the last one), in chunks
        of max_prefill_tokens; returns what the drafter reads for them, [P, H] (or
        [P, F*H] with feature layers). On a GPU each chunk is a padded forward of one row
        (``_prefill_rows``: a graph's when captured). ``headroom``: as ``prefill_many``'s."""
        end = request.seq_len - 1
        self.pages.resize(request.batch_slot, request.seq_len + headroom)
        # Padded (a GPU's): one-row forwards at padded shapes, a graph's when captured.
        slot = None if self.pad_prefill and self.batch_prefill else torch.tensor(
            [request.batch_slot], device=self.device)
        width = self.args.hidden_size * max(1, len(self.feature_layers))
        hidden = [torch.empty(0, width, dtype=self.dtype, device=self.device)]
        while request.num_cached < end:
            n = min(end - request.num_cached, self.max_prefill_tokens)
            if slot is None:
                hidden.append(self._prefill_rows([(0, request, n)], headroom)[0])
                continue
            chunk = request.token_ids[request.num_cached:request.num_cached + n]
            tokens = torch.tensor([chunk], device=self.device)
            start = torch.tensor([request.num_cached], device=self.device)
            hidden.append(self.forward(tokens, start, slot)[1][0])
            request.num_cached += n
        return torch.cat(hidden)
