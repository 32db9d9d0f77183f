"""specloop.serve: an OpenAI-compatible server on AsyncEngine, with Prometheus metrics and
a Perfetto trace; the worked example of embedding specloop (needs ``specloop[serve]``).

Public names load on first use (``specloop.samplers._lazy``), so that
``specloop serve --help`` answers without importing torch; mypy reads the imports under
``TYPE_CHECKING``."""

from typing import TYPE_CHECKING

from specloop.samplers._lazy import lazy_exports

if TYPE_CHECKING:
    from ._app import ServerState, build_app
    from ._metrics import ServeMetrics
    from ._protocol import ApiError
    from ._server import ServeOptions, serve
    from ._spec import SpecTracker

__all__ = ["ApiError", "ServeMetrics", "ServeOptions", "ServerState", "SpecTracker",
           "build_app", "serve"]

if not TYPE_CHECKING:      # mypy reads the imports above: an unknown name stays an error
    __getattr__, __dir__ = lazy_exports(globals(), {
        "._app": ("ServerState", "build_app"),
        "._metrics": ("ServeMetrics",),
        "._protocol": ("ApiError",),
        "._server": ("ServeOptions", "serve"),
        "._spec": ("SpecTracker",),
    })
