import specloop.engine as engine
import specloop.graphs as graphs
import specloop.models.drafters as drafters

ENGINE = {
    "AsyncEngine", "ComponentsConfig", "ConfigError", "ENTRY_POINT_GROUP", "EngineClosedError",
    "EngineConfig", "EngineStateError", "EngineStats", "FinishReason", "GraphsConfig", "IllegalTransitionError",
    "IterationMachine", "IterationObserver", "IterationRecord", "IterationState",
    "ModelConfig", "ParallelConfig", "ProcessEngine", "RequestError", "RequestOutput", "SchedulerConfig",
    "SpeculativeConfig", "TRANSITIONS", "TransitionEvent", "known_components",
}
GRAPHS = {"CudaGraphCache", "EagerGraphCache", "GraphCache", "GraphKey", "SamplingPath",
          "Step", "Tensors", "bucket_for"}
DRAFTERS = {"DraftContext", "DraftHead", "DraftModelDrafter", "DraftProposal", "Drafter",
            "DrafterConfigError", "DrafterDeps", "EarlyExitDrafter", "MtpEagleDrafter",
            "MtpEagleHead", "NgramDrafter", "VerifyObserver", "Eagle3Drafter", "Eagle3Head"}


def test_public_names():
    for module, names in ((engine, ENGINE), (graphs, GRAPHS), (drafters, DRAFTERS)):
        assert set(module.__all__) == names, module.__name__
        for name in names:
            assert getattr(module, name) is not None


def test_engine_stats_repr_shows_its_figures():
    from specloop.engine import EngineStats

    stats = EngineStats()
    stats.record_iteration(rows=2, k=4, accepted=3)
    text = repr(stats)
    assert "object at 0x" not in text
    assert "num_verify_rows=2" in text and "num_accepted_tokens=3" in text
    assert "mean_acceptance_length=2.500" in text and "acceptance_rate=0.375" in text
