"""The OpenAI-compatible HTTP server over one continuous batching manager (the ``serve`` extra).

``app``: ``create_app`` (Starlette routes); ``params``: request bodies -> validated settings;
``responses``: one request as OpenAI JSON or a stream; ``runs`` / ``bridge``: its choices in the
manager and their outputs on the event loop; ``choices``: tokens -> streamed text, stop strings,
logprobs; ``stoptext``: holding back a forming stop string; ``sse``: the event stream;
``command``: ``genfn serve``. Importing this package needs starlette (``pip install genfn[serve]``).
"""

from genfn.serve.app import create_app

__all__ = ["create_app"]
