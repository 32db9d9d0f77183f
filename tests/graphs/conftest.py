from ..engine.conftest import tiny_dir, tiny_draft_dir, tiny_loaded  # noqa: F401 (fixtures)
