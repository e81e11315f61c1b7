"""``hermes-env mcp``: any backend as an agent's terminal, over the Model Context Protocol.

This module only builds the command line; the ``mcp`` SDK is imported when
the server starts (``pip install 'hermes-env-core[mcp]'``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "main"]

DEFAULT_MAX_SESSIONS = 16
DEFAULT_IDLE_TIMEOUT_S = 1800.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``mcp`` command to ``hermes-env``'s subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "mcp",
        help="serve a shell on the chosen backend as an MCP server (stdio, or --http)",
        description=(
            "Serve hermes-env as a Model Context Protocol server: tools run, spawn, process_*, read_file and "
            "write_file, one environment per MCP session. Over stdio by default."
        ),
    )
    p.add_argument("--env", metavar="NAME", help="backend (default: $TERMINAL_ENV, the config file, else local)")
    p.add_argument(
        "-o", "--option", metavar="KEY=VALUE", action="append", default=[], type=_key_value,
        help="a backend option, highest precedence (repeatable; JSON for lists and dicts)",
    )
    p.add_argument("--config-file", metavar="PATH", help="config file (default: $HERMES_ENV_CONFIG, ./hermes-env.toml)")
    p.add_argument(
        "--http", metavar="[HOST:]PORT", type=_host_port,
        help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio (HOST defaults to 127.0.0.1)",
    )
    p.add_argument(
        "--token-file", metavar="PATH",
        help="(--http) file holding the bearer token clients must send, private to this user (chmod 600); "
             "default: $HERMES_ENV_MCP_TOKEN, else generate one and print it",
    )
    p.add_argument(
        "--max-sessions", metavar="N", type=_positive_int, default=DEFAULT_MAX_SESSIONS,
        help=f"(--http) concurrent MCP sessions, each with its own environment (default {DEFAULT_MAX_SESSIONS})",
    )
    p.add_argument(
        "--idle-timeout", metavar="SECONDS", type=_positive_float, default=DEFAULT_IDLE_TIMEOUT_S,
        help=f"(--http) close a session and its environment after this long without a connection "
             f"(default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--session", metavar="NAME",
        help="(stdio) serve the named session NAME (created on first use), left running when the client goes",
    )
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run the server until the client (stdio) or a signal (HTTP) ends it."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        print(
            "hermes-env mcp: error: the MCP SDK is not installed: pip install 'hermes-env-core[mcp]'", file=sys.stderr
        )
        return 2
    if getattr(args, "session", None) and args.http:
        print("hermes-env mcp: error: --session goes with stdio (one client attached at a time)", file=sys.stderr)
        return 2
    if args.token_file and not args.http:
        print("hermes-env mcp: error: --token-file goes with --http", file=sys.stderr)
        return 2
    from .serve import serve

    return serve(args)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port {number} is out of range 0-65535 (in {text!r})")
    return host, number


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value
