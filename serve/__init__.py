"""specloop.serve: an OpenAI-compatible server on AsyncEngine, with Prometheus metrics and
a Perfetto trace; the worked example of embedding specloop (needs ``specloop[serve]``)."""

from ._app import ServerState, build_app
from ._metrics import ServeMetrics
from ._protocol import ApiError
from ._server import ServeOptions, serve
from ._spec import SpecTracker

__all__ = ["ApiError", "ServeMetrics", "ServeOptions", "ServerState", "SpecTracker",
           "build_app", "serve"]
