"""The `mstar` command: serve, run, pull, worker, plugins, graph, bench serve."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _plugins(args: argparse.Namespace) -> int:
    from mstar_core.plugins.manager import discover

    registry = discover(extra_modules=args.plugin)
    print("plugins (entry-point group 'mstar'):")
    for info in registry.plugins:
        status = "ok" if info.loaded else f"FAILED: {info.error}"
        print(f"  {info.name:<20} {info.distribution:<28} {info.version:<10} {info.module:<40} {status}")
    sections = [("models", registry.models), ("engines", registry.engines), ("transports", registry.transports),
                ("attention backends", registry.attention_backends)]
    for title, reg in sections:
        names = [f"{name} ({reg.origin.get(name, '?')}{_link_note(reg, name) if reg is registry.transports else ''})"
                 for name in reg]
        print(f"{title}: {', '.join(names) or 'none'}")
    adapters = [f"{getattr(a, 'model', '?')}[{','.join(sorted(getattr(a, 'routes', ())))}]" for a in registry.api_adapters]
    print(f"api adapters: {', '.join(adapters) or 'none'}")
    return 1 if registry.failed() and args.strict else 0


def _link_note(transports, name: str) -> str:
    """How a transport can serve placement: carrying workers' tensors (same host only?), or not at all."""
    from mstar_core.cluster.links import carries_worker_links

    cls = transports.get(name)
    if not carries_worker_links(cls):
        return "; point to point only"
    return "; worker links, same host" if getattr(cls, "same_host", False) else "; worker links"


def _graph(args: argparse.Namespace) -> int:
    from mstar_core.graph import to_dot, to_mermaid
    from mstar_core.model import LoadOptions
    from mstar_core.plugins.manager import discover

    registry = discover(extra_modules=args.plugin)
    try:
        spec = registry.models.get(args.model)
    except KeyError as exc:
        print(f"mstar graph: {exc}", file=sys.stderr)
        return 2
    from mstar_core.checkpoint.errors import CheckpointError
    from mstar_core.checkpoint.hub import resolve_options

    options = LoadOptions(checkpoint=args.checkpoint) if args.checkpoint else LoadOptions(preset=args.preset)
    try:
        graph = spec.load(resolve_options(options)).graph
    except CheckpointError as exc:
        print(f"mstar graph: {exc}", file=sys.stderr)
        return 2
    walks = [args.walk] if args.walk else list(graph.walks)
    unknown = [w for w in walks if w not in graph.walks]
    if unknown:
        print(f"mstar graph: model '{args.model}' has no walk '{unknown[0]}'; walks: {', '.join(graph.walks)}",
              file=sys.stderr)
        return 2
    render = to_mermaid if args.format == "mermaid" else to_dot
    print("\n".join(render(graph, w) for w in walks), end="")
    return 0


def _pull(args: argparse.Namespace) -> int:
    """Fetch Hub checkpoints into the Hugging Face cache ahead of `mstar serve`, printing where each landed."""
    from mstar_core.checkpoint.errors import CheckpointError
    from mstar_core.checkpoint.hub import HubId, hub_cache_dir, pull

    status = 0
    for value in args.ids:
        if HubId.parse(value) is None:
            print(f"mstar pull: {value!r} is not a Hugging Face Hub id (write ORG/NAME or ORG/NAME@REVISION)",
                  file=sys.stderr)
            status = 2
            continue
        try:
            print(f"{value}: {pull(value, cache_dir=args.cache_dir or hub_cache_dir())}", flush=True)
        except CheckpointError as exc:
            print(f"mstar pull: {exc}", file=sys.stderr)
            status = 1
    return status


def _worker(args: argparse.Namespace) -> int:
    from mstar_core.cluster.worker import main as worker_main

    worker_main(args.worker_args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mstar_core import __version__
    from mstar_core.api.server import launch, offline
    from mstar_core.bench import serve as bench_serve

    parser = argparse.ArgumentParser(prog="mstar", description="M*: serve composite multimodal models.")
    parser.add_argument("--version", action="version", version=f"mstar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    launch.add_arguments(p)
    p.set_defaults(func=launch.serve)

    # its --help lists each installed model's example request (offline.ExamplesHelp discovers plugins then)
    p = sub.add_parser("run", help="run one request offline and write the result to a file", add_help=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    offline.add_arguments(p)
    p.set_defaults(func=offline.run)

    p = sub.add_parser("pull", help="download Hugging Face Hub checkpoints into the HF cache ahead of serving")
    p.add_argument("ids", nargs="+", metavar="ORG/NAME[@REVISION]")
    p.add_argument("--cache-dir", default=None, help="the cache to fill (default: HF_HUB_CACHE, else HF_HOME/hub, "
                                                      "else ~/.cache/huggingface/hub)")
    p.set_defaults(func=_pull)

    p = sub.add_parser("plugins", help="list discovered plugins, their versions and failures")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE", help="also register this module")
    p.add_argument("--strict", action="store_true", help="exit 1 if any plugin failed to load")
    p.set_defaults(func=_plugins)

    p = sub.add_parser("graph", help="print a model's walk(s) as Mermaid or Graphviz DOT")
    p.add_argument("model")
    p.add_argument("--walk", help="one walk (default: all)")
    p.add_argument("--format", choices=["mermaid", "dot"], default="mermaid")
    p.add_argument("--checkpoint", help="build from this checkpoint (default: the tiny preset)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE", help="also register this module")
    p.set_defaults(func=_graph)

    p = sub.add_parser("worker", help="join a server as a worker process (multi-process or multi-host placement)",
                       add_help=False)
    p.set_defaults(func=_worker)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench_command", required=True)
    b = bench.add_parser("serve", help="load-test an OpenAI-compatible speech or chat endpoint")
    bench_serve.add_arguments(b)
    b.set_defaults(func=bench_serve.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mstar` console script."""
    if argv is None and sys.argv[1:2] in (["serve"], ["run"], ["worker"]):
        from mstar_core.openmp import reexec_with_intel_openmp

        reexec_with_intel_openmp(sys.argv[1:])  # before torch loads (see openmp.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:  # the worker parses its own flags (and prints its own --help)
        return _worker(argparse.Namespace(worker_args=argv[1:])) or 0
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
