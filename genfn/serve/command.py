"""``genfn serve``: load a model, start one batching manager, serve the app with uvicorn.

``add_arguments(parser)`` adds the options to an ``argparse`` parser; ``main(args)`` runs the
server until SIGINT/SIGTERM and returns the exit status. Shutdown is graceful: the listener
closes, requests in flight get ``--drain-timeout`` seconds to finish (then end with an error
event or a 503), and the manager stops after them. Status lines go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time

from genfn.default_model import COMMAND_QUANTIZE, command_quantize

__all__ = ["add_arguments", "main"]

_DTYPES = ("float32", "bfloat16", "float16")
_QUANTIZE = COMMAND_QUANTIZE


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535 (0: any free port), got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _sampling_defaults(text: str):
    from genfn.serve.defaults import parse_sampling_defaults

    try:
        return parse_sampling_defaults(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None,
                        help="a GGUF file or a Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--model-name", default=None, help="the name clients ask for (default: the file's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32")
    parser.add_argument("--sampling-defaults", type=_sampling_defaults, default="auto", metavar="SPEC",
                        help="the sampling settings a request leaves out: 'auto' (the model's generation_config.json, "
                             "else temperature 0.7, top-p 0.95, top-k 50), 'none' (OpenAI's: temperature 1, top-p 1), "
                             "or key=value pairs over auto, e.g. temperature=0.5,top_p=0.9")
    parser.add_argument("--quantize", choices=_QUANTIZE, default=None,
                        help="'gguf' keeps a GGUF file's quantized blocks, 'none' loads every weight in --dtype, "
                             "'coded_bf16' (with --dtype bfloat16) keeps every weight in 12.2 bits, the others quantize on "
                             "load (default: none)")
    batching = parser.add_argument_group("continuous batching")
    batching.add_argument("--num-blocks", type=_positive_int, default=None, help="KV cache blocks (default: sized "
                                                                                "for the workload)")
    batching.add_argument("--block-size", type=_positive_int, default=None, help="tokens per KV cache block")
    batching.add_argument("--max-batch-tokens", type=_positive_int, default=None, help="tokens per forward")
    batching.add_argument("--max-requests", type=_positive_int, default=None, help="requests per forward")
    batching.add_argument("--scheduler", choices=("fifo", "prefill_first"), default="fifo")
    batching.add_argument("--no-prefix-caching", action="store_true", help="do not share the blocks of common "
                                                                            "prompt prefixes")
    batching.add_argument("--compile", action="store_true", help="torch.compile the batched forward")
    parser.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                        help="tensor parallelism over N ranks: `genfn serve --tp N` starts them on this machine, "
                             "`torchrun ... -m genfn serve --tp N` on several; rank 0 serves (docs/guides/distributed.md)")
    parser.add_argument("--drain-timeout", type=_seconds, default=30.0,
                        help="at shutdown, seconds requests in flight may still run (default 30)")
    return parser


def _status(message: str) -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() > 0:
        return  # tensor parallelism: rank 0 alone reports
    print(f"genfn serve: {message}", file=sys.stderr, flush=True)


def _model_name(path: str | None) -> str:
    if path is None:
        from genfn.default_model import DEFAULT_MODEL_FILE

        path = DEFAULT_MODEL_FILE
    name = os.path.basename(os.path.normpath(os.fspath(path)))
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def _batching_config(args):
    from genfn.config.batching import ContinuousBatchingConfig

    options = {"scheduler_type": args.scheduler, "allow_block_sharing": not args.no_prefix_caching,
               "num_blocks": args.num_blocks, "max_batch_tokens": args.max_batch_tokens,
               "max_requests_per_batch": args.max_requests, "default_compile_level": 1 if args.compile else 0}
    if args.block_size is not None:
        options["page_size"] = args.block_size
    return ContinuousBatchingConfig(**options)


def main(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        _status("the server needs fastapi and uvicorn: pip install 'genfn[serve]'")
        return 2
    import torch

    import genfn
    from genfn.batching.manager import ContinuousBatchingManager
    from genfn.serve.app import create_app

    started = time.perf_counter()
    options = {}
    if getattr(args, "tp", 1) > 1:
        shard = _tensor_shard(args.tp)
        if shard is None:
            return 2
        options["tensor_shard"] = shard
    _status(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ...")
    try:
        model = genfn.load(args.model, dtype=getattr(torch, args.dtype), quantize=command_quantize(args.quantize, args.model, args.dtype),
                           **options)
    except (OSError, ValueError) as exc:
        _status(f"cannot load the model: {exc}")
        return 1
    if model.tokenizer is None:
        _status("the model has no tokenizer; the server needs one to read and write text")
        return 1
    manager = ContinuousBatchingManager(model, continuous_batching_config=_batching_config(args))
    if manager.tensor_parallel_role == "follower":
        return _follow(manager)
    if args.compile:
        compiling = time.perf_counter()
        _status("compiling the batched forward for every padded size (first run: minutes) ...")
        manager.warmup()
        _status(f"compiled in {time.perf_counter() - compiling:.1f} s")
    manager.start()
    name = args.model_name or _model_name(args.model)
    app = create_app(manager, model.tokenizer, model_name=name, drain_timeout=args.drain_timeout,
                     sampling=args.sampling_defaults)
    _status(f"loaded {name} in {time.perf_counter() - started:.1f} s")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.drain_timeout + 5)
    server = _server(config, on_shutdown=app.state.genfn.begin_drain)
    try:
        server.run()
    finally:
        manager.stop(block=True, timeout=args.drain_timeout + 5)
        if manager.is_running():
            manager.stop(block=True, timeout=10, hard_stop=True)
        _status("stopped")
    return 0 if server.started else 1


def _tensor_shard(world_size: int):
    """This rank's ``TensorShard`` (the ranks were started by ``genfn serve --tp`` or torchrun), or
    None after saying how to start them."""
    import torch.distributed as dist

    from genfn.models.tensor_parallel import current_shard

    if not dist.is_initialized():
        _status(f"--tp {world_size} needs its ranks: run `genfn serve --tp {world_size} ...` (it starts them) or "
                f"`torchrun --nproc-per-node {world_size} -m genfn serve --tp {world_size} ...`")
        return None
    return current_shard()


def _follow(manager) -> int:
    """A rank other than 0 serves nothing: it runs rank 0's commands until rank 0's loop stops.
    Ctrl-C is rank 0's to handle (it drains, then stops every rank), so this rank ignores SIGINT."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    manager.start()
    manager.join()
    return 0 if manager.fatal_error is None else 1


def _server(config, on_shutdown):
    """uvicorn's server, telling the app when shutdown begins (so that streams can drain), printing
    the address it listens on, and returning from ``run`` after SIGINT/SIGTERM (uvicorn would raise
    the signal again on its way out, which ends the process before the manager is stopped)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                for server in self.servers:
                    for sock in server.sockets:
                        host, port = sock.getsockname()[:2]
                        _status(f"listening on http://{host}:{port} (OpenAI API at /v1, web page at /)")

        async def shutdown(self, sockets=None):
            _status("shutting down: finishing the requests in flight")
            on_shutdown()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)
