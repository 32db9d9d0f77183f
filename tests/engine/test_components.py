"""The one component registry: built-ins, entry points, import paths, and the names config
accepts (every [components] field and speculative.method) all come from it."""

import textwrap

import pytest

from specloop.engine import ENTRY_POINT_GROUP, AsyncEngine, ConfigError, EngineConfig, known_components
from specloop.samplers import SamplingParams

from .conftest import PROMPTS, collect, make_config

BUILTINS = {
    "sampler": {"default"},
    "communicator": {"single", "torch_distributed"},
    "graph_cache": {"eager", "cuda"},
    "drafter": {"ngram", "draft_model", "early_exit", "mtp_eagle", "eagle3"},
    "observer": set(),
}

PLUGIN = '''
from specloop.models.drafters import NgramDrafter


class ToyDrafter(NgramDrafter):
    """A plugin drafter: n-gram drafts under another name."""


class Counting:
    """A plugin observer: counts each state it sees."""

    def __init__(self, config):
        self.states = {}

    def on_transition(self, event):
        self.states[event.state.value] = self.states.get(event.state.value, 0) + 1


def shadow(*args):
    raise AssertionError("an entry point shadowed a built-in")
'''

ENTRY_POINTS = f'''
[{ENTRY_POINT_GROUP}]
drafter.toy = toy_specloop:ToyDrafter
observer.counting = toy_specloop:Counting
sampler.default = toy_specloop:shadow
drafter.ngram = toy_specloop:shadow
drafter.none = toy_specloop:shadow
nokind = toy_specloop:shadow
'''


def _install_toy(folder):
    (folder / "toy_specloop.py").write_text(PLUGIN)
    info = folder / "toy_specloop-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-specloop\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """An installed distribution registering drafter 'toy' (and trying to shadow built-ins)."""
    _install_toy(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "toy"


def test_a_package_installed_after_a_read_is_seen(tmp_path, monkeypatch):
    # The registry is memoized per state of sys.path's folders: installing into a folder
    # already on the path must still be seen (its new .dist-info changes the folder).
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "toy" not in known_components("drafter")
    _install_toy(tmp_path)
    assert known_components("drafter")["toy"] == "toy_specloop:ToyDrafter"


@pytest.mark.parametrize("kind", sorted(BUILTINS))
def test_builtins_are_registered_and_resolve(kind):
    from specloop.engine._components import resolve_component

    known = known_components(kind)
    assert set(known) == BUILTINS[kind]
    for name in known:
        assert callable(resolve_component(kind, name, f"components.{kind}"))


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="drafter"):
        known_components("scheduler")


def test_entry_point_drafter_is_registered_and_nameable_as_method(plugin):
    assert known_components("drafter")["toy"] == "toy_specloop:ToyDrafter"
    config = EngineConfig.from_dict({"speculative": {"method": "toy"}})
    assert config.speculative.method == "toy" and config.speculative.enabled
    EngineConfig.from_dict({"components": {"drafter": "toy"}})


def test_entry_points_cannot_shadow_builtins(plugin):
    assert known_components("sampler")["default"].startswith("specloop.")
    assert known_components("drafter")["ngram"].startswith("specloop.")
    assert "none" not in known_components("drafter")


@pytest.mark.parametrize("data, field", [
    ({"speculative": {"method": "medusa"}}, "speculative.method"),
    ({"components": {"drafter": "medusa"}}, "components.drafter"),
])
def test_unknown_drafter_error_lists_every_registered_name(plugin, data, field):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(data)
    message = str(info.value)
    assert message.startswith(f"{field} = 'medusa'"), message
    for name in known_components("drafter"):
        assert name in message
    assert "toy" in message


@pytest.mark.parametrize("kind", ["sampler", "communicator", "graph_cache"])
def test_unknown_component_error_lists_every_registered_name(kind):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"components": {kind: "nope"}})
    assert str(info.value).startswith(f"components.{kind} = 'nope': unknown {kind}")
    for name in BUILTINS[kind]:
        assert name in str(info.value)


def test_observers_are_a_list_of_registered_names(plugin):
    config = EngineConfig.from_dict({"components": {"observers": ["counting", "a.b:C"]}})
    assert config.components.observers == ("counting", "a.b:C")
    assert known_components("observer") == {"counting": "toy_specloop:Counting"}
    with pytest.raises(ConfigError, match=r"components.observers = 'nope': unknown observer; "
                                          r"use one of: counting;"):
        EngineConfig.from_dict({"components": {"observers": ["counting", "nope"]}})
    with pytest.raises(ConfigError, match="expected a list of strings"):
        EngineConfig.from_dict({"components": {"observers": "counting"}})


async def test_config_observers_see_every_iteration_before_passed_ones(plugin, tiny_dir,
                                                                      tiny_loaded):
    from specloop.engine import IterationState

    class Passed:
        def __init__(self):
            self.states = {}

        def on_transition(self, event):
            self.states[event.state.value] = self.states.get(event.state.value, 0) + 1

    passed = Passed()
    config = make_config(tiny_dir, method="toy",
                         components={"observers": ["counting", "toy_specloop:Counting"]})
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(config, model=tiny_loaded, observers=(passed,)) as engine:
        await collect(engine, PROMPTS[0], greedy)
    first, second, last = engine.observers
    assert type(first).__name__ == type(second).__name__ == "Counting" and last is passed
    assert first.states[IterationState.VERIFY.value] >= 2
    assert first.states == second.states == passed.states


def test_method_without_plugin_is_unknown():
    with pytest.raises(ConfigError, match="speculative.method = 'toy'"):
        EngineConfig.from_dict({"speculative": {"method": "toy"}})


def test_method_accepts_none_and_import_paths():
    assert not EngineConfig.from_dict({"speculative": {"method": "none"}}).speculative.enabled
    config = EngineConfig.from_dict({"speculative": {"method": "pkg.mod:Drafter"}})
    assert config.speculative.method == "pkg.mod:Drafter"


def test_import_path_that_does_not_import_fails_at_build():
    from specloop.engine._components import build_sampler

    config = EngineConfig.from_dict({"components": {"sampler": "no_such_pkg.mod:Fancy"}})
    with pytest.raises(ConfigError, match="cannot import no_such_pkg.mod:Fancy"):
        build_sampler(config)


async def test_engine_runs_a_plugin_drafter_by_name(plugin, tiny_dir, tiny_loaded):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    async def run(method):
        async with AsyncEngine(make_config(tiny_dir, method=method), model=tiny_loaded) as eng:
            outs = [await collect(eng, p, greedy) for p in PROMPTS[:3]]
            return outs, type(eng.worker.drafter).__name__, eng.stats

    plain, _, _ = await run("none")
    outs, drafter, stats = await run("toy")
    assert drafter == "ToyDrafter"
    assert stats.num_draft_tokens > 0
    assert outs == plain
