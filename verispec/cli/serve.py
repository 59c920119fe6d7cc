"""``verispec serve``: the OpenAI-compatible server (completions, chat, streaming, /metrics) on a model pair."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import sys
from dataclasses import replace
from typing import Any

from verispec.cli.options import add_model_options, draft_window, host, port, resolve_precisions

EPILOG = """\
examples:
  verispec serve
  verispec serve --port 8001 --api-key "$(openssl rand -hex 16)"
  verispec serve --target model.gguf --draft small.gguf --k 4 --served-model-name coder
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}'

The API key can also come from the VERISPEC_API_KEY environment variable (it then stays out of
the process list); an empty key is an error, not authentication turned off. With a key, /v1/* and
/metrics need it (--public-metrics opens /metrics), /health stays open and /docs, /redoc and
/openapi.json are off. JSON endpoints take only Content-Type: application/json, and the Host header
must be an IP address, localhost or a name given with --allowed-host (against DNS rebinding).
Ctrl-C stops admitting requests, lets the ones in flight finish (up to --shutdown-timeout
seconds), then exits; a second Ctrl-C aborts them at once, each client told so."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model pair over an OpenAI-compatible HTTP API with Prometheus metrics",
        description="Serve speculative decoding over HTTP: /v1/completions and /v1/chat/completions "
        "(streamed or not, OpenAI's schema plus a `spec` object with the acceptance figures of each "
        "request), /v1/models, /health and /metrics (Prometheus, vLLM's metric names under verispec:).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p)
    p.add_argument(
        "--host", type=host, default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = all)"
    )
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $VERISPEC_API_KEY, else no key)",
    )  # fmt: skip
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key (scrapers)")
    p.add_argument(
        "--allowed-host", action="append", default=[], metavar="NAME",
        help="a host name clients may reach the server by, besides IP addresses and localhost (repeatable; "
        "'*' turns the Host check off)",
    )  # fmt: skip
    p.add_argument(
        "--served-model-name", action="append", default=[], metavar="NAME",
        help="the model name clients send (repeatable: aliases; default the target's name)",
    )  # fmt: skip
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together at most (default 8)")
    p.add_argument("--max-len", type=int, default=4096, help="tokens per sequence, prompt + output (default 4096)")
    p.add_argument(
        "--max-queue", type=int, default=64,
        help="requests that may wait beyond the running batch; more get 429 with Retry-After (default 64)",
    )  # fmt: skip
    p.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="longest prompt accepted (default --max-len - 1)"
    )
    p.add_argument(
        "--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted (default --max-len - 1)"
    )
    p.add_argument(
        "--max-prompt-bytes", type=int, default=None,
        help="longest prompt text accepted, refused before tokenizing (default 32 x --max-prompt-tokens)",
    )  # fmt: skip
    p.add_argument("--max-messages", type=int, default=512, help="messages per chat request (default 512)")
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="seconds to let requests in flight finish at shutdown before aborting them (default 30)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from verispec.errors import ConfigError

    try:
        import uvicorn

        from verispec.server import ServerConfig, create_app
        from verispec.server.shutdown import GracefulServer
    except ImportError as exc:
        raise ConfigError(
            f"`verispec serve` needs {exc.name}; install the server's dependencies: pip install 'verispec[serve]'"
        ) from None
    from rich.console import Console

    from verispec.kernels.hugepages import HUGE_PAGES_ENV
    from verispec.pipeline import build

    api_key = args.api_key if args.api_key is not None else os.environ.get("VERISPEC_API_KEY")
    if api_key is not None and not api_key:
        where = "--api-key" if args.api_key is not None else "VERISPEC_API_KEY"
        raise ConfigError(f"{where} is empty; give a key, or leave it unset to serve without one")
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name), api_key=api_key, public_metrics=args.public_metrics,
        allowed_hosts=tuple(args.allowed_host), max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit, max_prompt_bytes=args.max_prompt_bytes, max_messages=args.max_messages,
        shutdown_grace_seconds=args.shutdown_timeout,
    )  # fmt: skip
    if args.host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::") and not _loopback(args.host):
        # the name (or address) clients use to reach it must pass the Host check too
        config = replace(config, allowed_hosts=(*config.allowed_hosts, args.host.lower()))
    err = Console(stderr=True)
    picked = resolve_precisions(args)  # (said once the models load: a bad option fails alone, in one line)
    # a server loads once and decodes for hours: its weights on huge pages (a slower load, faster passes)
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    with err.status("loading models (prepare them once with `verispec models prepare`)", spinner="dots"):
        pipe = build(
            args.target, args.draft, drafter=args.drafter, k=args.k, dtype=args.dtype,
            draft_dtype=args.draft_dtype, device=args.device, max_batch=args.max_batch, max_len=args.max_len,
            draft_head=args.draft_vocab, tree=args.tree, tree_children=args.tree_children, rule=args.rule,
            allow_lossy=args.allow_lossy,
            datastore=args.datastore, heads=args.heads, confidence_stop=args.confidence_stop,
            draft_window=draft_window(args),
        )  # fmt: skip
    if picked:
        print(picked, file=sys.stderr)
    app = create_app(pipe, config)
    runner = app.state.server.runner
    names = ", ".join(app.state.server.names)
    pair = f"{pipe.target.name} <- {pipe.draft.name if pipe.draft is not None else args.drafter}"
    if config.api_key is None and not _loopback(args.host):
        err.print(f"[yellow]warning:[/] listening on {args.host} without --api-key: anyone who can reach it can use it")

    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + 5,  # the runner's abort comes first, with a message
    )  # fmt: skip
    print(f"verispec: serving {names} ({pair}) at http://{args.host}:{args.port}/v1", file=sys.stderr)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises SIGINT once it has shut down cleanly
        GracefulServer(uv_config, runner, args.shutdown_timeout).run()
    print("verispec: server stopped", file=sys.stderr)
    return 0
