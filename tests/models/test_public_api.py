import specloop.models as models


def test_all_names_exist_and_are_public():
    for name in models.__all__:
        assert hasattr(models, name), name
    assert not [n for n in models.__all__ if n.startswith("_")]
    assert sorted(models.__all__) == sorted(set(models.__all__))


def test_known_models_is_immutable():
    assert "smollm2-135m-instruct" in models.KNOWN_MODELS
    try:
        models.KNOWN_MODELS["x"] = None  # type: ignore[index]
    except TypeError:
        pass
    else:
        raise AssertionError("KNOWN_MODELS must be read-only")
