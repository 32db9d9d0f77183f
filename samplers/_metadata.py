"""SpecMetadata: the per-iteration flags and the one predicate everyone reads."""

from __future__ import annotations

from typing import Any

import attrs


def _optional_bool(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"SpecMetadata.{attr.name} = {value!r}: must be None or a bool")


@attrs.frozen
class SpecMetadata:
    """Whether this iteration drafts and verifies on the advanced (sampled) path.

    `group_all_greedy_sample` is the AND over the ADP group, set in SYNC when the config
    gate is on; it overrides the local flag so every rank takes the same path.
    """

    use_rejection_sampling: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    is_all_greedy_sample: bool = attrs.field(
        default=True, validator=attrs.validators.instance_of(bool))
    group_all_greedy_sample: bool | None = attrs.field(default=None, validator=_optional_bool)

    @property
    def all_greedy(self) -> bool:
        if self.group_all_greedy_sample is not None:
            return self.group_all_greedy_sample
        return self.is_all_greedy_sample

    @property
    def wants_advanced_draft_sampling(self) -> bool:
        # The one predicate: the sampler branch, the drafter's LM head and the graph key
        # all read it; nothing recomputes it.
        return self.use_rejection_sampling and not self.all_greedy

    def evolve(self, **changes: Any) -> SpecMetadata:
        return attrs.evolve(self, **changes)
