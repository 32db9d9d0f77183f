"""Building the components an engine is configured with (one place for each)."""

from __future__ import annotations

from ._components import resolve_component
from ._errors import ConfigError


def default_sampler(config):
    from specloop.samplers import DefaultSampler  # noqa: PLC0415
    # Input validation syncs with the host, which graph capture forbids.
    return DefaultSampler(method=config.speculative.verification,
                          validate=config.components.graph_cache != "cuda")


def build_sampler(config):
    return resolve_component("sampler", config.components.sampler, "components.sampler")(config)


def build_graph_cache(config):
    return resolve_component("graph_cache", config.components.graph_cache,
                             "components.graph_cache")(config)


def build_communicator(config):
    return resolve_component("communicator", config.components.communicator,
                             "components.communicator")(config)


def build_drafter(config, deps):
    from specloop.models.drafters import DrafterConfigError  # noqa: PLC0415

    if not config.speculative.enabled:
        return None
    name = config.components.drafter or config.speculative.method
    try:
        return resolve_component("drafter", name, "components.drafter")(config, deps)
    except DrafterConfigError as exc:
        raise ConfigError(exc.field, exc.value, exc.problem, exc.fix) from exc


def single_communicator(config):
    from specloop.comm import SingleRankCommunicator  # noqa: PLC0415
    return SingleRankCommunicator()


def torch_distributed_communicator(config):
    from specloop.comm import TorchDistributedCommunicator  # noqa: PLC0415
    device = "cuda" if config.model.device.startswith("cuda") or (
        config.model.device == "auto" and _cuda()) else "cpu"
    return TorchDistributedCommunicator.from_env(
        device=device, checked=config.parallel.checked_collectives,
        timeout=config.parallel.collective_timeout_s)


def _cuda() -> bool:
    import torch  # noqa: PLC0415
    return torch.cuda.is_available()
