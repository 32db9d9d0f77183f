import pytest

from specloop.engine import ConfigError, EngineConfig, known_components

EXAMPLES = ["examples/smollm2-ngram.toml", "examples/smollm2-eagle3.toml"]


@pytest.mark.parametrize("path", EXAMPLES)
def test_examples_load(path):
    config = EngineConfig.from_toml(path)
    assert config.model.name == "smollm2-135m-instruct"


def test_defaults_are_valid_and_frozen():
    config = EngineConfig()
    with pytest.raises(AttributeError):
        config.model.max_seq_len = 5  # frozen: change with attrs.evolve


def test_from_dict_round_trip():
    config = EngineConfig.from_dict({"speculative": {"method": "none"}})
    assert EngineConfig.from_dict(config.to_dict()) == config
    assert config.speculative.k == 0


@pytest.mark.parametrize("data, field, words", [
    ({"parallel": {"lm_head_tp_in_adp": True}}, "parallel.lm_head_tp_in_adp", "attention_dp"),
    ({"parallel": {"context_parallel_size": 2}, "speculative": {"use_rejection_sampling": True}},
     "speculative.use_rejection_sampling", "context parallelism"),
    ({"speculative": {"num_draft_tokens": 0}}, "speculative.num_draft_tokens", "[1, 16]"),
    ({"speculative": {"num_draft_tokens": 17}}, "speculative.num_draft_tokens", "[1, 16]"),
    ({"speculative": {"method": "medusa"}}, "speculative.method", "ngram"),
    ({"speculative": {"method": "draft_model"}}, "speculative.draft_model", "draft model"),
    ({"speculative": {"verification": "tree"}}, "speculative.verification", "block"),
    ({"speculative": {"ngram_min": 4, "ngram_max": 2}}, "speculative.ngram_min", "ngram_max"),
    ({"components": {"sampler": "fancy"}}, "components.sampler", "default"),
    ({"components": {"communicator": "mpi"}}, "components.communicator", "single"),
    ({"components": {"graph_cache": "xla"}}, "components.graph_cache", "eager"),
    ({"components": {"drafter": "eagle9"}}, "components.drafter", "ngram"),
    ({"model": {"dtype": "int8"}}, "model.dtype", "bfloat16"),
    ({"model": {"device": "tpu"}}, "model.device", "cuda"),
    ({"model": {"max_seq_len": 4}}, "model.max_seq_len", ">= 16"),
    ({"scheduler": {"max_batch_size": 0}}, "scheduler.max_batch_size", ">= 1"),
    ({"scheduler": {"idle_wait_s": -1}}, "scheduler.idle_wait_s", "> 0"),
    ({"parallel": {"world_size": 0}}, "parallel.world_size", ">= 1"),
    ({"model": {"max_seq_ln": 4}}, "model.max_seq_ln", "unknown key"),
    ({"speculative": {"use_rejection_sampling": "false"}},
     "speculative.use_rejection_sampling", "true or false"),
    ({"scheduler": {"max_batch_size": 2.7}}, "scheduler.max_batch_size", "an integer"),
    ({"scheduler": {"max_batch_size": "4"}}, "scheduler.max_batch_size", "an integer"),
    ({"speculative": {"num_draft_tokens": True}}, "speculative.num_draft_tokens", "an integer"),
    ({"model": {"name": 5}}, "model.name", "a string"),
    ({"parallel": {"world_size": 2}}, "parallel.attention_dp", "attention_dp = true"),
    ({"parallel": {"context_parallel_size": 2}}, "parallel.context_parallel_size",
     "not implemented"),
    ({"speculative": {"method": "none"}, "components": {"drafter": "ngram"}},
     "components.drafter", "method"),
    ({"modle": {}}, "modle", "unknown key"),
])
def test_gates_and_bad_values_name_the_field(data, field, words):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict(data)
    assert str(info.value).startswith(field), str(info.value)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_component_lists_known_ones():
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_dict({"components": {"drafter": "nope"}})
    for name in known_components("drafter"):
        assert name in str(info.value)


def test_import_path_components_are_accepted():
    config = EngineConfig.from_dict({"components": {"sampler": "mypkg.samplers:Fancy"}})
    assert config.components.sampler == "mypkg.samplers:Fancy"


def test_rejection_sampling_allowed_under_adp_with_and_without_lm_head_tp():
    for tp in (False, True):
        config = EngineConfig.from_dict({"parallel": {"world_size": 2, "attention_dp": True,
                                                      "lm_head_tp_in_adp": tp},
                                         "speculative": {"use_rejection_sampling": True}})
        assert config.speculative.use_rejection_sampling and config.parallel.attention_dp
        # The group-synced greedy flag is gated on exactly LM-head TP + rejection sampling.
        assert config.group_sync_greedy_flag is tp


def test_missing_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        EngineConfig.from_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nname=")
    with pytest.raises(ConfigError, match="invalid TOML"):
        EngineConfig.from_toml(bad)
