"""The OpenAI-compatible HTTP server over one continuous batching manager (the ``serve`` extra).

``app``: ``create_app`` (Starlette routes); ``params``: request bodies -> validated settings;
``runs`` / ``bridge``: one request's choices in the manager and their outputs on the event loop;
``choices``: tokens -> streamed text, stop strings, logprobs; ``sse``: the event stream;
``command``: ``genfn serve``. Importing this package needs starlette (``pip install genfn[serve]``).
"""

from genfn.serve.app import create_app

__all__ = ["create_app"]
