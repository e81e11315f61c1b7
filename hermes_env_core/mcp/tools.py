"""The tools ``hermes-env mcp`` offers: names, descriptions, input and output JSON schemas.

Plain data (no MCP import); arguments are checked against ``input`` before a
tool runs, so a bad value is a tool error naming the argument.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .session import DEFAULT_OUTPUT_BYTES, DEFAULT_READ_BYTES, MAX_WAIT_S

__all__ = ["TOOLS", "ToolSpec", "check_arguments"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    input: dict[str, Any]
    output: dict[str, Any]
    read_only: bool = False


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def _out(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props)}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_NUM = {"type": "number"}
_OPT_INT = {"type": ["integer", "null"]}
_OPT_STR = {"type": ["string", "null"]}
_OPT_NUM = {"type": ["number", "null"]}
_PID = {"type": "string", "description": "the id spawn returned (bg-...)"}
_TASK = {"type": "string", "description": "the environment's task id (one environment per MCP session)"}

_PROCESS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": _STR,
        "command": _STR,
        "status": {"type": "string", "enum": ["running", "exited", "killed", "lost"]},
        "pid": _OPT_INT,
        "exit_code": _OPT_INT,
        "started_at": _NUM,
        "ended_at": _OPT_NUM,
        "pty": _BOOL,
        "output_bytes": _INT,
        "watch": {"type": "array", "items": _STR},
        "note": _OPT_STR,
    },
    "required": ["id", "command", "status", "pid", "exit_code", "started_at", "ended_at", "pty", "output_bytes"],
}

TOOLS: dict[str, ToolSpec] = {
    t.name: t
    for t in (
        ToolSpec(
            "run",
            "Run a shell command",
            "Run a bash command in this session's long-lived shell and return its merged stdout/stderr and exit "
            "code. Variables, functions, aliases, options and the working directory persist between calls of "
            "one MCP session. Exit code 124: timed out; 126: the cwd cannot be entered; 130: cancelled. "
            "Long commands report their output so far as progress notifications.",
            _obj(
                {
                    "command": {"type": "string", "minLength": 1, "description": "bash command line or script"},
                    "cwd": {"type": "string", "description": "run in this directory (the session's cwd is kept)"},
                    "timeout": {"type": "number", "exclusiveMinimum": 0, "description": "seconds; default: the backend's"},
                    "stdin": {"type": "string", "description": "text passed to the command's standard input"},
                },
                ("command",),
            ),
            _out(
                {
                    "output": _STR,
                    "exit_code": _INT,
                    "cwd": _OPT_STR,
                    "timed_out": _BOOL,
                    "interrupted": _BOOL,
                    "truncated": _BOOL,
                    "notes": {"type": "array", "items": _STR},
                    "duration_s": _NUM,
                    "task_id": _TASK,
                    "end_reason": {
                        "type": "string",
                        "enum": ["exited", "signaled", "timed_out", "cancelled", "oom_killed"],
                        "description": "why the command ended",
                    },
                    "signal": _OPT_INT,
                    "usage": {
                        "type": "object",
                        "description": "what the command cost; null where the target cannot tell",
                        "properties": {
                            "cpu_user_s": _OPT_NUM,
                            "cpu_system_s": _OPT_NUM,
                            "max_rss_bytes": _OPT_INT,
                            "oom_killed": {"type": ["boolean", "null"]},
                        },
                        "required": ["cpu_user_s", "cpu_system_s", "max_rss_bytes", "oom_killed"],
                        "additionalProperties": False,
                    },
                }
            ),
        ),
        ToolSpec(
            "spawn",
            "Start a background process",
            "Start a command in the background with the session's state and cwd. Returns its id at once. "
            "Lines matching a watch pattern, and its exit, are sent as log notifications and returned by "
            "process_wait. It is killed when the MCP session ends.",
            _obj(
                {
                    "command": {"type": "string", "minLength": 1},
                    "cwd": _STR,
                    "watch": {"type": "array", "items": {"type": "string", "minLength": 1},
                              "description": "report output lines containing any of these substrings"},
                    "watch_regex": {"type": "array", "items": {"type": "string", "minLength": 1},
                                    "description": "report output lines matching any of these regular expressions"},
                    "pty": {"type": "boolean", "description": "run it on a pseudo-terminal"},
                },
                ("command",),
            ),
            {**_PROCESS, "properties": {**_PROCESS["properties"], "task_id": _TASK},
             "required": [*_PROCESS["required"], "task_id"]},
        ),
        ToolSpec(
            "process_output",
            "Read a background process's output",
            "Output of a background process from byte offset `since` (pass the previous next_offset to read "
            "only what is new). `dropped` counts bytes that already left the rolling buffer.",
            _obj(
                {
                    "id": _PID,
                    "since": {"type": "integer", "minimum": 0},
                    "max_bytes": {"type": "integer", "minimum": 1, "maximum": 16 * 1024 * 1024,
                                  "description": f"default {DEFAULT_OUTPUT_BYTES}"},
                },
                ("id",),
            ),
            _out(
                {
                    "id": _STR,
                    "output": _STR,
                    "offset": _INT,
                    "next_offset": _INT,
                    "dropped": _INT,
                    "end": _INT,
                    "status": _STR,
                    "exit_code": _OPT_INT,
                }
            ),
            read_only=True,
        ),
        ToolSpec(
            "process_wait",
            "Wait for a background process",
            "Wait until the process exits or prints a watched line not reported by an earlier process_wait, "
            "or until `timeout` seconds pass. `event` says which: exit, match or timeout.",
            _obj(
                {"id": _PID, "timeout": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S, "description": "default 30"}},
                ("id",),
            ),
            _out(
                {
                    "id": _STR,
                    "event": {"type": "string", "enum": ["exit", "match", "timeout"]},
                    "matches": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"pattern": _STR, "line": _STR, "suppressed": _INT},
                            "required": ["pattern", "line", "suppressed"],
                        },
                    },
                    "status": _STR,
                    "exit_code": _OPT_INT,
                    "output_end": _INT,
                    "tail": _STR,
                }
            ),
            read_only=True,
        ),
        ToolSpec(
            "process_kill",
            "Stop a background process",
            "End a background process and all its children (SIGTERM, then SIGKILL), or send it one signal.",
            _obj({"id": _PID, "signal": {"type": "string", "description": "only send this signal, e.g. INT, HUP"}}, ("id",)),
            _out({"id": _STR, "status": _STR, "exit_code": _OPT_INT, "signal": _OPT_STR}),
        ),
        ToolSpec(
            "process_list",
            "List background processes",
            "The session's background processes, running and recently ended.",
            _obj({}),
            _out({"processes": {"type": "array", "items": _PROCESS}, "task_id": _TASK}),
            read_only=True,
        ),
        ToolSpec(
            "process_write",
            "Write to a background process's stdin",
            "Send text to a background process's standard input (its terminal, with pty); optionally close it.",
            _obj({"id": _PID, "data": _STR, "close_stdin": _BOOL}, ("id", "data")),
            _out({"id": _STR, "bytes_written": _INT, "stdin_closed": _BOOL}),
        ),
        ToolSpec(
            "read_file",
            "Read a file",
            "Read a file in the environment (a path relative to the session's cwd). Text comes back as utf-8, "
            "anything else as base64. At most max_bytes from offset; `truncated` says there is more.",
            _obj(
                {
                    "path": {"type": "string", "minLength": 1},
                    "offset": {"type": "integer", "minimum": 0},
                    "max_bytes": {"type": "integer", "minimum": 1, "maximum": 16 * 1024 * 1024,
                                  "description": f"default {DEFAULT_READ_BYTES}"},
                },
                ("path",),
            ),
            _out(
                {
                    "path": _STR,
                    "size": _INT,
                    "offset": _INT,
                    "bytes": _INT,
                    "truncated": _BOOL,
                    "encoding": {"type": "string", "enum": ["utf-8", "base64"]},
                    "content": _STR,
                    "task_id": _TASK,
                }
            ),
            read_only=True,
        ),
        ToolSpec(
            "write_file",
            "Write a file",
            "Write (or append to) a file in the environment, relative to the session's cwd. `content` is text, "
            "or base64 with encoding=base64 for binary data.",
            _obj(
                {
                    "path": {"type": "string", "minLength": 1},
                    "content": _STR,
                    "encoding": {"type": "string", "enum": ["utf-8", "base64"]},
                    "append": _BOOL,
                    "make_dirs": {"type": "boolean", "description": "create missing parent directories"},
                },
                ("path", "content"),
            ),
            _out({"path": _STR, "bytes_written": _INT, "append": _BOOL, "task_id": _TASK}),
        ),
    )
}


@functools.cache
def _validator(name: str) -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(TOOLS[name].input)


def check_arguments(spec: ToolSpec, arguments: dict[str, Any]) -> str | None:
    """None when ``arguments`` fit the tool's input schema, else one sentence naming the first bad one."""
    validator = _validator(spec.name)
    # An unknown name first: it is usually a misspelling of the required one that is "missing".
    errors = sorted(validator.iter_errors(arguments),
                    key=lambda e: (e.validator != "additionalProperties", [str(p) for p in e.absolute_path]))
    if not errors:
        return None
    err = errors[0]
    if err.validator == "additionalProperties":
        unknown = sorted(set(arguments) - set(spec.input["properties"]))
        return f"{spec.name}: unknown argument(s) {', '.join(map(repr, unknown))}; it takes {', '.join(spec.input['properties'])}"
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "required":
        return f"{spec.name}: {err.message}"
    return f"{spec.name}: argument {where!r}: {err.message}"
