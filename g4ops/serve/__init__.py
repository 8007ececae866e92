"""The OpenAI-compatible HTTP server over `g4ops.engine.batch.BatchEngine` (`python -m g4ops serve`): wire format in
`protocol`, routes in `app`, Prometheus metrics in `metrics`, the command line in `cli`. Needs the `serve` extra
(fastapi, uvicorn, prometheus_client); the names below load it on first use, so `cli`'s arguments do not."""

__all__ = ["create_app", "GenerationDefaults"]


def __getattr__(name):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "GenerationDefaults":
        from .params import GenerationDefaults

        return GenerationDefaults
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
