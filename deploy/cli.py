"""`pdcluster`: the one command line.

pdcluster model tiny|smollm2 [DIR]     build a local model (no network needed)
pdcluster serve [--model smollm2] ...  Ray head on loopback, engines, router on 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from rich.console import Console

from deploy.serve_flags import add_serve_parser, env_default
from engine.models import BUILDERS
from router.log_limit import limit_repeats

console = Console(stderr=True)


def _add_model_parser(subparsers) -> None:
    parser = subparsers.add_parser("model", help="build a local model checkpoint")
    parser.add_argument("name", choices=sorted(BUILDERS))
    parser.add_argument("dir", nargs="?", type=Path, help="target folder (default: the model cache)")
    parser.set_defaults(func=_cmd_model)


def _cmd_serve(args: argparse.Namespace) -> int:
    from deploy.serve import serve  # imports nothing of Ray before use_ray() has run

    return serve(args)


def _add_module_parser(subparsers, name: str, module_name: str, help: str) -> None:
    """A subcommand whose arguments and runner live in `module_name` (add_arguments, run),
    imported only when it runs: the load tests' dependencies are an extra, not the product's."""

    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser(prog=f"pdcluster {name}", description=module.__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(parser)
        return module.run(parser.parse_args(args.rest))

    subparsers.add_parser(name, help=help, add_help=False).set_defaults(func=run, delegated=True)


def _add_cluster_parsers(subparsers) -> None:
    launch = add_serve_parser(subparsers, _cmd_serve, "launch", "start router and pools on a running Ray cluster")
    launch.set_defaults(address="auto")
    up = subparsers.add_parser("up", help="`ray up` a cluster YAML, then launch pdcluster on its head")
    up.add_argument("cluster_yaml", type=Path)
    up.add_argument("launch_args", nargs=argparse.REMAINDER, help="flags for `pdcluster launch` (--port ...)")
    up.set_defaults(func=_cmd_up)
    down = subparsers.add_parser("down", help="stop pdcluster and `ray down` the cluster")
    down.add_argument("cluster_yaml", type=Path)
    down.set_defaults(func=_cmd_down)
    _add_status_parsers(subparsers)


def _add_status_parsers(subparsers) -> None:
    status = subparsers.add_parser("status", help="pools, instances, starts, hit rates, store, errors")
    top = subparsers.add_parser("top", help="`pdcluster status`, redrawn in place until Ctrl-C")
    for parser in (status, top):
        parser.add_argument("--url", default=f"http://127.0.0.1:{env_default('PORT', '8000')}", help="the router")
        parser.add_argument("--secret-file", type=Path, help="the cluster's secret (as for serve)")
    status.add_argument("--print-admin-token", action="store_true",
                        help="print the admin token (the status page's password) and exit")
    status.set_defaults(func=_cmd_status)
    top.add_argument("--interval", type=_positive(float), default=2.0, help="seconds between refreshes")
    top.add_argument("--refreshes", type=_positive(int), help="stop after this many refreshes (default: Ctrl-C)")
    top.set_defaults(func=_cmd_top)


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0: {text}")
        return value

    return parse


def _cmd_up(args: argparse.Namespace) -> int:
    from deploy import cluster

    port_parser = argparse.ArgumentParser(add_help=False)
    port_parser.add_argument("--port", type=int, default=8000)
    args.port = port_parser.parse_known_args(args.launch_args)[0].port
    try:
        url = cluster.up(args.cluster_yaml, args.launch_args, args.port)
    except (cluster.ClusterConfigError, RuntimeError, TimeoutError, OSError) as exc:  # CredentialsError too
        console.print(f"[red]pdcluster up failed:[/] {exc}")
        return 1
    console.print(
        f"pdcluster is serving on the head at {url} (`ray attach {args.cluster_yaml} -p {args.port}`)"
    )
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from deploy import cluster

    cluster.down(args.cluster_yaml)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from rich.text import Text

    from deploy.status_view import StatusSource, StatusUnavailable, render_status
    from security.credentials import ClusterCredentials

    try:
        credentials = ClusterCredentials.load(args.secret_file)
    except RuntimeError as exc:  # CredentialsError
        console.print("[red]no cluster secret:[/]", Text(str(exc)))
        return 1
    if args.print_admin_token:
        print(credentials.admin_token)
        return 0
    try:
        status = StatusSource(args.url.rstrip("/"), credentials.admin_headers()).fetch()
    except StatusUnavailable as exc:
        console.print("[red]no router status:[/]", Text(str(exc)))
        return 1
    Console().print(render_status(status, args.url))
    console.print(f"The page: {args.url.rstrip('/')}/status (any user name; the password: "
                  "`pdcluster status --print-admin-token`)", highlight=False)
    return 0


def _cmd_top(args: argparse.Namespace) -> int:
    from rich.text import Text

    from deploy.status_view import StatusSource, watch
    from security.credentials import ClusterCredentials

    try:
        source = StatusSource(args.url.rstrip("/"), ClusterCredentials.load(args.secret_file).admin_headers())
    except RuntimeError as exc:  # CredentialsError
        console.print("[red]no cluster secret:[/]", Text(str(exc)))
        return 1
    try:
        return 0 if watch(source, Console(), args.interval, args.refreshes) else 1
    except KeyboardInterrupt:  # Ctrl-C is how `top` ends
        return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from engine.models import ensure_model

    print(ensure_model(args.name, args.dir))
    return 0


def command_parser() -> argparse.ArgumentParser:
    """`pdcluster`'s parser. An argument `@FILE` stands for FILE's lines, one argument each (the
    pool flags `pdcluster plan --serve-args FILE` writes, for `serve`)."""
    parser = argparse.ArgumentParser(
        prog="pdcluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        fromfile_prefix_chars="@",
    )
    subparsers = parser.add_subparsers(required=True, metavar="COMMAND")
    _add_model_parser(subparsers)
    add_serve_parser(subparsers, _cmd_serve)
    _add_cluster_parsers(subparsers)
    _add_module_parser(subparsers, "simulate", "loadtest.simulate",
                       "replay a Mooncake trace through the routing policies")
    _add_module_parser(subparsers, "plan", "loadtest.pd_plan",
                       "size prefill and decode pools for a workload, an SLO and a GPU count (simulated)")
    _add_module_parser(subparsers, "loadtest", "loadtest.command", "load an OpenAI endpoint and report")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limit_repeats()  # a flood's repeated log lines (router/log_limit.py)
    parser = command_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "delegated", False):
        args.rest = rest  # its own parser reads them
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: everything started was stopped on the way out
        return 130


if __name__ == "__main__":
    sys.exit(main())
