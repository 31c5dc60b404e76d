"""The OpenAI-compatible HTTP server over one continuous batching manager (the ``serve`` extra).

``app``: ``create_app`` (FastAPI routes, ``/openapi.json``, ``/docs``); ``schemas``: the request and
response bodies as pydantic models; ``params``: validated bodies -> sampling settings; ``defaults``:
the sampling defaults (model's generation config, else the chat defaults); ``tools`` /
``structured``: tool calls and output constraints; ``responses``: one request as OpenAI JSON or a
stream; ``runs`` / ``bridge``: its choices in the manager and their outputs on the event loop;
``choices``: tokens -> streamed text, stop strings, logprobs; ``stoptext``: holding back a forming
stop string; ``sse``: the event stream; ``command``: ``genfn serve``. Importing ``create_app``
needs fastapi (``pip install genfn[serve]``); ``genfn.serve.defaults`` needs nothing.
"""

__all__ = ["create_app"]


def __getattr__(name):
    if name == "create_app":
        from genfn.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'genfn.serve' has no attribute {name!r}")
