"""The subcommands that describe the setup: ``backends``, ``options``, ``config`` and ``doctor``.

``backends`` and ``options`` import no backend (``options`` imports only the
config model); ``doctor`` imports each backend and checks its requirements.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ..environment.base import BaseEnvironment
from ..errors import HermesEnvError
from ..plugins.registry import KNOWN_BACKENDS, BackendRegistry, get_registry
from ..plugins.spec import API_VERSION, BackendSpec
from .common import PROG, add_command, environment, exit_status_of, factory_for, print_table

__all__ = ["add_commands"]

_SECRET_RE = re.compile(r"password|passphrase|secret|token|api_key|apikey", re.IGNORECASE)


def add_commands(sub: argparse._SubParsersAction, env_opts: argparse.ArgumentParser) -> None:  # type: ignore[type-arg]
    p = add_command(
        sub,
        "backends",
        "list installed backends and plugins",
        "List every installed backend with its aliases, distribution and version, and whether it can be "
        "loaded: a backend whose SDK is missing is shown as not loadable, with the line that installs it. "
        "Also lists plugins that failed to load, names provided twice, and known backends not installed. "
        "Imports no backend.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_backends, lists_plugins=True)

    p = add_command(
        sub,
        "options",
        "list a backend's options with type, default and description",
        "List each option of BACKEND, from its pydantic config model: name, type, default and description. "
        "Set them with -o KEY=VALUE, TERMINAL_<KEY> or the [terminal.BACKEND] table of the config file.",
    )
    p.add_argument("backend", metavar="BACKEND", help="backend name or alias")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_options)

    p = add_command(
        sub,
        "config",
        "show the effective options and where each comes from",
        "Show the backend that would be used and every option's effective value with its source "
        "(argument, TERMINAL_* variable, config file, default). TERMINAL_* variables and [terminal] keys "
        "that are not options of that backend are listed as ignored, with the reason. Secrets are masked.",
        parents=[env_opts],
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_config)

    p = add_command(
        sub,
        "doctor",
        "check backends' requirements; exit 1 if any problem",
        "Import each installed backend (or those named) and check its requirements; report plugins that "
        "failed to load. With --env or -o, also resolve that backend's configuration, start the environment "
        "and run a command in it. Exits 0 when everything checked is fine, 1 otherwise.",
        parents=[env_opts],
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="backends to check (default: all installed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor, lists_plugins=True)


# -- backends ------------------------------------------------------------------------


def cmd_backends(args: argparse.Namespace) -> int:
    registry = get_registry()
    rows = [_backend_row(registry, spec) for spec in registry.backends.values()]
    failed = _failed_plugins(registry)
    conflicts = {key: [s.distribution for s in specs] for key, specs in registry.conflicts.items()}
    missing = _not_installed(registry)
    if args.json:
        payload = {"api_version": API_VERSION, "backends": rows, "failed_plugins": failed, "conflicts": conflicts,
                   "not_installed": missing}
        print(json.dumps(payload, indent=2))
        return 0
    table = [["NAME", "ALIASES", "DISTRIBUTION", "VERSION", "API", "STATUS"]]
    for row in rows:
        status = "loadable" if row["loadable"] else f"not loadable: {row['reason']}"
        table.append(
            [row["name"], ",".join(row["aliases"]) or "-", row["distribution"] or "-", row["version"] or "-",
             row["api_version"], status]
        )
    print_table(table)
    if failed:
        print("\nplugins that failed to load (their backends are unavailable):")
        for f in failed:
            where = f" {f['version']}" if f["version"] else ""
            print(f"  {f['plugin']} ({f['distribution'] or 'unknown distribution'}{where}): failed: {f['error']}")
    if conflicts:
        print("\nnames provided twice (unusable until one provider is uninstalled):")
        for key, dists in conflicts.items():
            print(f"  {key}: {' and '.join(d or 'a plugin registered in code' for d in dists)}")
    if missing:
        print("\nknown backends not installed:")
        for item in missing:
            print(f"  {item['name']}: {item['install']}")
    print(f"\nplugin API of this core: {API_VERSION} (a plugin built for another major version is refused)")
    print(f"(listing imports no backend; `{PROG} doctor` imports each and checks its requirements)")
    return 0


def _failed_plugins(registry: BackendRegistry) -> list[dict[str, Any]]:
    return [
        {"plugin": p.name, "distribution": p.distribution, "version": p.version, "entry_point": p.value, "error": p.error}
        for p in registry.failed
    ]


def _backend_row(registry: BackendRegistry, spec: BackendSpec) -> dict[str, Any]:
    info = registry.provider(spec.name)
    loadable, reason = registry.availability(spec.name)
    return {
        "name": spec.name,
        "aliases": list(spec.aliases),
        "distribution": spec.distribution,
        "version": info.version if info else None,
        "api_version": spec.api_version,
        "summary": spec.summary,
        "target": spec.target,
        "loadable": loadable,
        "reason": reason,
        "install": spec.install_hint,
    }


def _not_installed(registry: BackendRegistry) -> list[dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for key, known in KNOWN_BACKENDS.items():
        if known.name in registry.backends or key in registry.aliases or key in registry.backends:
            continue
        item = out.setdefault(known.name, {"name": known.name, "install": known.install_hint, "aliases": ""})
        if key != known.name:
            item["aliases"] = ",".join(filter(None, [item["aliases"], key]))
    for item in out.values():
        if item["aliases"]:
            item["name"] = f"{item['name']} ({item['aliases']})"
        del item["aliases"]
    return list(out.values())


# -- options ---------------------------------------------------------------------------


def cmd_options(args: argparse.Namespace) -> int:
    registry = get_registry()
    name = registry.canonical(args.backend)
    model = registry.config_model(name)
    rows = option_rows(model)
    if args.json:
        print(json.dumps({"backend": name, "options": rows}, indent=2))
        return 0
    print(f"options of backend {name!r} ({model.__module__}.{model.__qualname__}):")
    for row in rows:
        default = "required" if row["required"] else f"default {json.dumps(row['default'])}"
        print(f"  {row['name']}: {row['type']}, {default}")
        if row["description"]:
            print(f"      {row['description']}")
    return 0


def option_rows(model: type[BaseModel]) -> list[dict[str, Any]]:
    rows = []
    for key, field in model.model_fields.items():
        if field.default_factory is not None:
            default: Any = field.default_factory()  # type: ignore[call-arg]
        elif field.default is PydanticUndefined:
            default = None
        else:
            default = field.default
        required = field.is_required()
        rows.append(
            {
                "name": key,
                "type": type_name(field.annotation),
                "default": _jsonable(key, default),
                "required": bool(required),
                "description": field.description or "",
            }
        )
    return rows


def type_name(annotation: Any) -> str:
    """A short, readable spelling of an option's type (``float | None``, ``list of str``)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        inner = type_name(args[0])
        return "size (e.g. 2g, 512m)" if any("memory" in repr(a) for a in args[1:]) else inner
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (tuple, list, set, frozenset):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {type_name(args[0])} -> {type_name(args[1])}" if args else "table"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return f"table ({annotation.__name__})"
        return {"str": "str", "int": "int", "float": "float", "bool": "bool"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation).replace("typing.", "")


# -- config ----------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> int:
    resolved = factory_for(args).resolve(args.env, option_strings=dict(args.option))
    values = {k: _jsonable(k, v.value) for k, v in resolved.values.items()}
    ignored = [{"key": i.key, "source": i.source, "reason": i.reason} for i in resolved.ignored]
    if args.json:
        payload = {
            "backend": {"value": resolved.backend, "source": resolved.backend_source},
            "config_file": resolved.config_file,
            "options": {k: {"value": values[k], "source": v.source} for k, v in resolved.values.items()},
            "ignored": ignored,
        }
        print(json.dumps(payload, indent=2))
        return 0
    print(f"backend = {resolved.backend}    ({resolved.backend_source})")
    print(f"config file: {resolved.config_file or 'none'}")
    table = [[f"{k} = {json.dumps(values[k])}", v.source] for k, v in resolved.values.items()]
    print_table(table, indent="  ")
    if ignored:
        print("ignored:")
        print_table([[i["source"], i["reason"]] for i in ignored], indent="  ")
    return 0


def _jsonable(key: str, value: Any) -> Any:
    if value is not None and _SECRET_RE.search(key):
        return "********"
    if isinstance(value, BaseModel):
        return _jsonable(key, value.model_dump())
    if isinstance(value, dict):
        return {str(k): _jsonable(str(k), v) for k, v in value.items()}
    if isinstance(value, (tuple, list, set, frozenset)):
        return [_jsonable("", v) for v in value]
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


# -- doctor ----------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    registry = get_registry()
    probe = bool(args.env or args.option)
    names = list(args.names)
    if args.env:
        names.append(args.env)
    if probe and not names:
        names = [factory_for(args).resolve(None, option_strings=dict(args.option)).backend]
    checked_all = not names
    names = names or registry.names()
    report: dict[str, Any] = {"api_version": API_VERSION, "backends": [], "failed_plugins": [], "not_installed": []}
    for name in names:
        entry: dict[str, Any] = {"name": name, "ok": True, "problems": []}
        report["backends"].append(entry)
        try:
            cls = registry.load(name)
        except HermesEnvError as exc:
            entry.update(ok=False, problems=[str(exc)], load_error=True)
            continue
        entry["problems"] = _check(cls)
        entry["mode"] = _mode(cls)
        if not entry["problems"] and probe:
            entry["problems"], entry["probe"] = _probe(args, name)
            entry["mode"] = _probed_mode.pop(name, entry["mode"])
        entry["ok"] = not entry["problems"]
        if _probed_notes.get(name):
            entry["notes"] = _probed_notes.pop(name)
    if checked_all or probe:
        report["failed_plugins"] = _failed_plugins(registry)
    if checked_all:
        report["not_installed"] = _not_installed(registry)
    bad = any(not e["ok"] for e in report["backends"]) or bool(report["failed_plugins"])
    report["ok"] = not bad
    if args.json:
        print(json.dumps(report, indent=2))
        return 1 if bad else 0
    for entry in report["backends"]:
        if entry["ok"]:
            extra = f" ({entry['probe']})" if entry.get("probe") else ""
            print(f"{entry['name']}: ok{extra}")
            if entry.get("mode"):
                print(f"  commands: {entry['mode']}")
            for note in entry.get("notes", ()):
                print(f"  note: {note}")
        elif entry.get("load_error"):
            print(f"{entry['name']}: FAIL: {entry['problems'][0]}")
        else:
            print(f"{entry['name']}: {len(entry['problems'])} problem(s)")
            for problem in entry["problems"]:
                print(f"  - {problem}")
    for f in report["failed_plugins"]:
        where = f" {f['version']}" if f["version"] else ""
        print(f"plugin {f['plugin']} ({f['distribution'] or 'unknown distribution'}{where}): FAIL: {f['error']}")
    if checked_all:
        print(f"plugin API of this core: {API_VERSION}")
    for item in report["not_installed"]:
        print(f"{item['name']}: not installed ({item['install']})")
    return 1 if bad else 0


_probed_mode: dict[str, str] = {}


def _mode(cls: type[BaseEnvironment]) -> str | None:
    """How this backend's commands reach its target by default (resident channel or processes)."""
    from ..environment.base import BaseEnvironment as _Base

    opener = getattr(cls, "_open_channel", None)
    if opener is None or not isinstance(cls, type) or not issubclass(cls, _Base):
        return None
    if opener is _Base._open_channel:
        return "one bash per command, the state restored each time (the backend offers no stream to a server)"
    if any("offers_channel" in vars(k) for k in cls.__mro__ if k is not _Base):  # decided by its target
        return "session server where the target offers open_channel, else one bash per command"
    field = cls.config_model.model_fields.get("channel")
    on = field.get_default(call_default_factory=True) if field is not None else True
    if on:
        return "session server (one bash in the target holds the session)"
    return "one bash per command, the state restored each time (channel=true starts a session server)"


def _check(cls: type[BaseEnvironment]) -> list[str]:
    check = getattr(cls, "check_requirements", None)
    if check is None:
        return []
    try:
        return [str(p) for p in (check() or [])]
    except Exception as exc:
        return [f"check_requirements() raised {type(exc).__name__}: {exc}"]


def _probe(args: argparse.Namespace, name: str) -> tuple[list[str], str | None]:
    """Start the environment as configured and run one command in it."""
    probe_args = argparse.Namespace(**{**vars(args), "env": name, "timeout": None})
    started = time.monotonic()
    problems: list[str] = []
    try:
        with environment(probe_args) as env:
            result = env.execute("echo hermes-env-doctor", timeout=120)
            _probed_mode[name] = env.channel_mode
            if result.exit_code == 0:
                problems, _probed_notes[name] = _background_tools(env)
    except HermesEnvError as exc:
        kind = "configuration" if exit_status_of(exc) == 2 else "start"
        return [f"{kind}: {exc}"], None
    if result.exit_code != 0 or "hermes-env-doctor" not in result.output:
        return [f"a probe command failed with exit status {result.exit_code}: {result.output.strip()[:200]}"], None
    return problems, f"started and ran a command in {time.monotonic() - started:.1f}s"


_probed_notes: dict[str, list[str]] = {}


def _background_tools(env: BaseEnvironment) -> tuple[list[str], list[str]]:
    """What ``run --background`` needs in the target: missing required programs are problems, optional ones notes."""
    from ..processes import sandbox_scripts
    from ..processes.sandbox import missing_tools, target_label

    required = sandbox_scripts.REQUIRED_TOOLS
    optional = sandbox_scripts.OPTIONAL_TOOLS
    missing = missing_tools(env, required + tuple(optional))
    where = target_label(env)
    lacking = [t for t in missing if t in required]
    problems = [
        f"background processes (run --background) need {', '.join(required)} in the target; {where} has no "
        f"{', '.join(lacking)}: install coreutils there"
    ] if lacking else []
    notes = [f"{where} has no {t}: {optional[t]}" for t in missing if t in optional]
    return problems, notes

