"""The `rewa` command line."""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rewa", description="rewa: geometric retrieval attention")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP service (settings: REWA_* variables)")
    serve.add_argument("--host", help="default: REWA_HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, help="default: REWA_PORT or 8000")
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.host:
            os.environ["REWA_HOST"] = args.host
        if args.port is not None:
            os.environ["REWA_PORT"] = str(args.port)
        from rewa.service.server import serve as run_server

        run_server()


if __name__ == "__main__":
    main()
