"""Per-request sampling parameters and their batched, per-row tensor form.

torch is imported where a batch is built, not at module level: the CLI validates
SamplingParams (``specloop generate --temperature -1``) without importing torch."""

from __future__ import annotations

import array
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import attrs

from ._errors import SamplingParamsError

if TYPE_CHECKING:
    import torch

INT64_MAX = 2**63 - 1
# SamplingBatch holds temperature as float32 and multiplies by its reciprocal: both must be
# finite and normal there, so a value passing validation can never produce NaN later.
TEMPERATURE_MIN = 1e-6
TEMPERATURE_MAX = 1e6


def _fail(field: str, value: object, rule: str, fix: str) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{field} = {value!r} is invalid: {rule}; {fix}")


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass, but True as a top_k is a bug, not a value.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_temperature(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not _is_real(value) or not math.isfinite(value) or not (
            value == 0 or TEMPERATURE_MIN <= value <= TEMPERATURE_MAX):
        raise _fail(attr.name, value,
                    f"must be 0 or a number in [{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}]",
                    "use 0 for greedy decoding or a positive value such as 1.0")


def _check_top_k(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    # Held as int64 in SamplingBatch.top_k; any k >= the vocabulary means "off".
    if not _is_int(value) or not 0 <= value <= INT64_MAX:
        raise _fail(attr.name, value, "must be an int in [0, 2**63 - 1]",
                    "use 0 to turn top-k off")


def _check_top_p(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not _is_real(value) or not math.isfinite(value) or not 0 < value <= 1:
        raise _fail(attr.name, value, "must be in (0, 1]", "use 1.0 to turn top-p off")


def _check_min_p(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not _is_real(value) or not math.isfinite(value) or not 0 <= value <= 1:
        raise _fail(attr.name, value, "must be in [0, 1]", "use 0.0 to turn min-p off")


def _check_seed(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not _is_int(value) or not 0 <= value <= INT64_MAX):
        raise _fail(attr.name, value, "must be None or an int in [0, 2**63 - 1]",
                    "pass None to get a seed at admission")


def _check_max_tokens(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not _is_int(value) or not 1 <= value <= INT64_MAX:
        raise _fail(attr.name, value, "must be an int in [1, 2**63 - 1]",
                    "ask for at least one token")


def _check_stop_ids(_inst: object, attr: attrs.Attribute[Any], value: tuple[object, ...]
                    ) -> None:
    if not all(_is_int(t) and 0 <= t <= INT64_MAX for t in value):
        raise _fail(attr.name, value, "must hold int token ids in [0, 2**63 - 1]",
                    "remove negative or non-integer ids")


def _to_stop_strings(value: object) -> tuple[Any, ...]:
    # One string is one stop string, not a sequence of one-character stops.
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Sequence):
        raise _fail("stop", value, "must be a string or a sequence of strings",
                    'pass e.g. "\\n\\n" or ("User:", "###")')
    return tuple(value)


def _check_stop(_inst: object, attr: attrs.Attribute[Any], value: tuple[object, ...]
                ) -> None:
    if not all(isinstance(s, str) and s for s in value):
        raise _fail(attr.name, value, "must hold non-empty strings",
                    "remove empty or non-string entries")


def _check_bool(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise _fail(attr.name, value, "must be a bool", "pass True or False")


def _check_detokenize(inst: SamplingParams, attr: attrs.Attribute[Any], value: object) -> None:
    _check_bool(inst, attr, value)
    if not value and inst.stop:
        raise _fail(attr.name, value, f"stop strings {inst.stop!r} are matched on the text",
                    "pass detokenize=True, or stop by token id (stop_token_ids)")


def _to_tuple(value: object) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SamplingParamsError(
            f"SamplingParams.stop_token_ids = {value!r} is invalid: must be a sequence of "
            "token ids; pass e.g. (2,) or ()")
    return tuple(value)


@attrs.frozen
class SamplingParams:
    """What a request asks of the sampler; validated at construction."""

    temperature: float = attrs.field(default=1.0, validator=_check_temperature)
    top_k: int = attrs.field(default=0, validator=_check_top_k)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    min_p: float = attrs.field(default=0.0, validator=_check_min_p)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    max_tokens: int = attrs.field(default=16, validator=_check_max_tokens)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_to_tuple, validator=_check_stop_ids)
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)
    # Stop strings, matched on the detokenized text; the output ends before the match.
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_stop_strings,
                                        validator=_check_stop)
    # False: outputs carry token ids only (``text`` ""), and the front door runs no
    # detokenizer for the request (a token-id client: ~30 % less of its host time an
    # output, bench/bench_parent_outputs.py).
    detokenize: bool = attrs.field(default=True, validator=_check_detokenize)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# Greedy and padding rows carry neutral params so the vectorised math stays finite;
# `is_greedy` then replaces their probabilities by a one-hot argmax row.
_SENTINEL = SamplingParams(temperature=1.0)


@attrs.frozen(eq=False)
class SamplingBatch:
    """Per-row sampling tensors for a batch of B rows (real rows first, then padding)."""

    temperature: torch.Tensor  # [B] f32
    top_k: torch.Tensor  # [B] i64, 0 = off
    top_p: torch.Tensor  # [B] f32
    min_p: torch.Tensor  # [B] f32
    is_greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] i64
    all_greedy: bool  # over the real rows; True when there are none
    num_real: int
    needs_sort: bool = False  # some row uses top-k or top-p (Python flag: no device sync)
    needs_min_p: bool = False
    any_greedy: bool = True  # some row (padding included) is greedy
    # from_params: each column's host values (``like`` compares them); else None.
    host: Mapping[str, Any] | None = attrs.field(default=None, repr=False)
    # from_params / changed: per real row, 0 greedy, else 1 | 2 (top-k or top-p) | 4
    # (min-p), so ``changed`` derives the flags without the rows' params; None where
    # ``host`` is not this batch's rows' own (e.g. a greedy batch keeping another's seeds).
    row_flags: array.array[int] | None = attrs.field(default=None, repr=False)

    # The per-row tensor fields, in order (graph inputs copy exactly these).
    COLUMNS = ("temperature", "top_k", "top_p", "min_p", "is_greedy", "seeds")

    @property
    def size(self) -> int:
        return int(self.seeds.shape[0])

    def columns(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.COLUMNS}

    def real_rows(self) -> SamplingBatch:
        """The batch of the real rows alone, as views of these columns (nothing built or
        copied; padding rows hold the sentinel, so the flags other than ``any_greedy``
        are the same), with their host values and flags (so ``changed`` can slice it at
        the next batch change). Needs ``host`` (from_params) where there is padding."""
        n = self.num_real
        if n == self.size:
            return self
        return self.first_rows(n)

    def first_rows(self, n: int) -> SamplingBatch:
        """The batch of this one's first ``n`` rows (its real ones, or any number of an
        all-greedy batch's: padding rows are greedy with the sentinel's params), as views
        of its columns and slices of its host values; ``row_flags`` where they are those
        rows' own (None past the real rows). Needs ``host``."""
        if self.host is None:
            raise ValueError("first_rows / real_rows of a batch not built by from_params "
                             "(no host values)")
        if n != self.num_real and not self.all_greedy:
            # (its flags are its real rows': fewer rows may have others)
            raise ValueError(f"first_rows: {n} rows of a batch of {self.num_real} real rows "
                             "that is not all greedy")
        greedy = self.host["is_greedy"][:n]
        flags = self.row_flags
        # All the rows: the same column tensors, not views of them. A graph replay copies
        # an input whose tensor it has not seen (views are new tensors each time), so an
        # all-greedy batch at its bucket's size, taken from another batch's rows at every
        # batch change, would otherwise copy all six columns into the graphs' inputs.
        columns = {} if n == self.size else \
            {name: getattr(self, name)[:n] for name in self.COLUMNS}
        return attrs.evolve(self, num_real=n, any_greedy=any(greedy),
                            host={name: values[:n] for name, values in self.host.items()},
                            row_flags=None if flags is None else
                            (flags[:n] if n <= len(flags) else None),
                            **columns)

    def with_columns(self, columns: Mapping[str, torch.Tensor]) -> SamplingBatch:
        """The same Python flags over other per-row tensors (e.g. static graph inputs)."""
        return attrs.evolve(self, host=None, row_flags=None,
                            **{name: columns[name] for name in self.COLUMNS})

    @classmethod
    def padding(cls, rows: int, *, all_greedy: bool, device: torch.device | str = "cpu"
                ) -> SamplingBatch:
        """``rows`` padding rows with the Python flags a captured variant is specialised
        on: argmax-only when ``all_greedy``, else every sampling feature on (no-op features
        leave probabilities bit-identical) -- the template a step is captured or warmed
        up with."""
        template = cls.from_params([], [], device=device, pad_to=rows)
        if all_greedy:
            return template
        return attrs.evolve(template, all_greedy=False, needs_sort=True, needs_min_p=True,
                            any_greedy=True)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int], *,
                    device: torch.device | str = "cpu", pad_to: int | None = None,
                    like: SamplingBatch | None = None) -> SamplingBatch:
        """``like``: an earlier batch of as many rows (the same padding, another batch of
        requests): each column whose values are its is its tensor (nothing copied to the
        device; a graph replay given the same tensor again copies nothing either; at a
        batch change most columns of greedy rows are the sentinel's)."""
        if len(seeds) != len(params):
            raise ValueError(f"from_params: {len(params)} params but {len(seeds)} seeds; "
                             "pass one seed per request")
        _check_seeds(seeds, "from_params")
        size = _size(len(params), pad_to, "from_params")
        return cls._from_host(*_host_rows(None, None, (), params, seeds, size - len(params)),
                              size=size, device=device, like=like)

    def changed(self, keep: Sequence[tuple[int, int]], params: Sequence[SamplingParams],
                seeds: Sequence[int], *, device: torch.device | str = "cpu",
                pad_to: int | None = None, like: SamplingBatch | None = None
                ) -> SamplingBatch:
        """This batch's real rows ``[a, b)`` for each ``(a, b)`` of ``keep`` (in order),
        then rows for ``params`` / ``seeds``, then padding to ``pad_to``: bit for bit
        what ``from_params`` gives for those rows' params and seeds (``like`` as there),
        the kept rows sliced out of ``host`` (C copies) instead of built from Python
        numbers (~1 us a row at a batch change: requests end anywhere, join at the end).
        Needs ``host`` and ``row_flags`` (a batch of from_params or changed)."""
        if self.host is None or self.row_flags is None:
            raise ValueError("changed: a batch without its rows' host values (built by "
                             "from_params or changed) has no rows to keep")
        if len(seeds) != len(params):
            raise ValueError(f"changed: {len(params)} params but {len(seeds)} seeds; "
                             "pass one seed per request")
        if any(not 0 <= a <= b <= self.num_real for a, b in keep):
            raise ValueError(f"changed: keep={keep!r} is not within the {self.num_real} "
                             "real rows")
        _check_seeds(seeds, "changed")
        real = sum(b - a for a, b in keep) + len(params)
        size = _size(real, pad_to, "changed")
        return self._from_host(
            *_host_rows(self.host, self.row_flags, keep, params, seeds, size - real),
            size=size, device=device, like=like)

    @classmethod
    def _from_host(cls, floats: array.array[float], ints: array.array[int],
                   bools: array.array[int], row_flags: array.array[int], *, size: int,
                   device: torch.device | str, like: SamplingBatch | None) -> SamplingBatch:
        """The batch of these host buffers (floats: temperature, top_p, min_p; ints: top_k,
        seeds; bools: is_greedy; each ``size`` rows) and real rows' flags."""
        import torch  # noqa: PLC0415 - see the module docstring

        # Each column: (its values, where it lies in the host buffers).
        values = {"temperature": floats[:size], "top_p": floats[size:2 * size],
                  "min_p": floats[2 * size:], "top_k": ints[:size], "seeds": ints[size:],
                  "is_greedy": bools}
        kept: dict[str, torch.Tensor] = {}
        if like is not None and like.host is not None and like.size == size \
                and like.seeds.device.type == torch.device(device).type:
            kept = {name: getattr(like, name) for name, was in like.host.items()
                    if values[name] == was}
        columns = dict(kept)
        if len(kept) < len(values):
            f, i, b = _to_device([_host(floats, torch.float32, (3, size)),
                                  _host(ints, torch.int64, (2, size)),
                                  _host(bools, torch.bool, (size,))], device)
            made = {"temperature": f[0], "top_p": f[1], "min_p": f[2], "top_k": i[0],
                    "seeds": i[1], "is_greedy": b}
            columns = {name: kept.get(name, made[name]) for name in values}
        real = len(row_flags)
        return cls(
            **columns, host=values, row_flags=row_flags,
            all_greedy=row_flags.count(0) == real, num_real=real,
            needs_sort=3 in row_flags or 7 in row_flags,
            needs_min_p=5 in row_flags or 7 in row_flags,
            any_greedy=size > real or 0 in row_flags,
        )


def _check_seeds(seeds: Sequence[int], caller: str) -> None:
    if not all(type(s) is int and 0 <= s <= INT64_MAX for s in seeds):
        for s in seeds:     # the check again, naming the seed (int subclasses pass)
            if not _is_int(s) or not 0 <= s <= INT64_MAX:
                raise ValueError(f"{caller}: seed {s!r} is not an int in [0, 2**63 - 1]")


def _size(real: int, pad_to: int | None, caller: str) -> int:
    size = real if pad_to is None else pad_to
    if size < real:
        raise ValueError(f"{caller}: pad_to={pad_to} < {real} requests; "
                         "pad to at least the batch size")
    return size


def _host_rows(host: Mapping[str, Any] | None, row_flags: array.array[int] | None,
               keep: Sequence[tuple[int, int]], params: Sequence[SamplingParams],
               seeds: Sequence[int], pad: int
               ) -> tuple[array.array[float], array.array[int], array.array[int],
                          array.array[int]]:
    """``_from_host``'s buffers (floats, ints, bools) and real rows' flags: ``host``'s rows
    ``[a, b)`` for each ``(a, b)`` of ``keep`` (sliced: C copies), then rows for ``params``
    / ``seeds``, then ``pad`` padding rows. Greedy and padding rows hold the sentinel (no
    top-k, top-p or min-p). Three host buffers (float32, int64, bool rows), packed from
    Python numbers by ``array`` (a torch.tensor per column cost ~4 us each), one copy to
    a GPU."""
    greedy = [p.is_greedy for p in params]
    rows = [_SENTINEL if g else p for p, g in zip(params, greedy)]

    def column(name: str, typecode: str, new: list[Any], padding: Any,
               into: array.array[Any] | None = None) -> array.array[Any]:
        out = array.array(typecode) if into is None else into
        if keep:
            assert host is not None
            was = host[name]
            for a, b in keep:
                out += was[a:b]
        # Built from a list, then appended whole: ~2x faster than ``extend`` a number at
        # a time.
        out += array.array(typecode, new + [padding] * pad if pad else new)
        return out

    floats = column("temperature", "f", [p.temperature for p in rows], _SENTINEL.temperature)
    column("top_p", "f", [p.top_p for p in rows], _SENTINEL.top_p, floats)
    column("min_p", "f", [p.min_p for p in rows], _SENTINEL.min_p, floats)
    ints = column("top_k", "q", [p.top_k for p in rows], _SENTINEL.top_k)
    column("seeds", "q", list(seeds), 0, ints)
    bools = column("is_greedy", "b", greedy, True)
    flags = array.array("b")
    if keep:
        assert row_flags is not None
        for a, b in keep:
            flags += row_flags[a:b]
    flags += _row_flags(params, greedy)
    return floats, ints, bools, flags


def _row_flags(params: Sequence[SamplingParams], greedy: list[bool]) -> array.array[int]:
    """Per row: 0 greedy (the sentinel's params: no top-k, top-p or min-p), else
    1 | 2 (top-k or top-p: sorts) | 4 (min-p)."""
    return array.array("b", [0 if g else 1 | (p.top_k > 0 or p.top_p < 1) << 1
                             | (p.min_p > 0) << 2 for p, g in zip(params, greedy)])


def _host(values: array.array[Any], dtype: torch.dtype, shape: tuple[int, ...]
          ) -> torch.Tensor:
    """``values`` as a host tensor of ``shape`` (sharing the array's memory)."""
    import torch  # noqa: PLC0415 - see the module docstring

    if not values:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype).view(shape)


def _to_device(hosts: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """The host tensors on ``device``; to a GPU in one copy from pinned memory, without
    waiting (a copy from pageable memory may wait for the work already queued, e.g. the
    engine's step queued ahead, issue 12; a copy per column cost a copy launch each, per
    batch change and padding; torch's caching host allocator keeps the pinned buffer
    until the copy is done)."""
    import torch  # noqa: PLC0415 - see the module docstring

    if torch.device(device).type != "cuda" or not any(h.numel() for h in hosts):
        return [h.to(device) for h in hosts]    # (no rows: nothing is copied)
    return packed_to_device(hosts, device, pin=True)


def packed_to_device(hosts: list[torch.Tensor], device: torch.device | str, *, pin: bool
                     ) -> list[torch.Tensor]:
    """Host tensors on ``device`` through one copy: each one's bytes at a 16-byte
    aligned offset of one (``pin``: pinned) buffer (as aligned as an allocation, for
    kernels specialised on it), viewed back as its dtype there."""
    import torch  # noqa: PLC0415 - see the module docstring

    sizes = [h.numel() * h.element_size() for h in hosts]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // 16) * 16
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    for h, at, size in zip(hosts, offsets, sizes):
        buffer[at:at + size] = h.contiguous().view(-1).view(torch.uint8)
    moved = buffer.to(device, non_blocking=True)
    return [moved[at:at + size].view(h.dtype).view(h.shape)
            for h, at, size in zip(hosts, offsets, sizes)]
