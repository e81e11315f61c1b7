"""Toolbox (daemon) routes, reached through ``{toolbox_url}/{sandbox_id}/...``.

The SDK asks the control plane for the toolbox proxy URL (the Sandbox DTO's
``toolboxProxyUrl``, or ``GET /sandbox/{id}/toolbox-proxy-url`` when that is
empty) and prefixes every toolbox path with ``/{sandbox_id}``.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import time
import urllib.parse
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from daytona_toolbox_api_client import (
    Command,
    CreateSessionRequest,
    ExecuteRequest,
    ExecuteResponse,
    FileInfo,
    FilesDownloadRequest,
    FsFileResult,
    Session,
    SessionCommandLogsResponse,
    SessionExecuteRequest,
    SessionExecuteResponse,
    UploadFilesResponse,
    UserHomeDirResponse,
    WorkDirResponse,
)
from python_multipart.multipart import MultipartParser, parse_options_header

from .errors import SOURCE_PROXY, HttpError, daemon_error
from .processes import ShellSession, run_command
from .sandboxes import EmulatedSandbox
from .wire import Request, Response, Router, empty, json_response

if TYPE_CHECKING:
    from .emulator import DaytonaEmulator


def _parse_model(model, req: Request):
    try:
        parsed = model.from_dict(req.json())
    except HttpError:
        raise
    except Exception as exc:
        raise daemon_error(400, f"invalid request body: {exc}", "INVALID_REQUEST_BODY") from exc
    if parsed is None:
        raise daemon_error(400, "request body is required", "INVALID_REQUEST_BODY")
    return parsed


def parse_multipart(content_type: str, body: bytes) -> list[tuple[dict[str, str], bytes]]:
    """The parts of a multipart/form-data body as (content-disposition params, data)."""
    ctype, options = parse_options_header(content_type)
    if ctype != b"multipart/form-data" or b"boundary" not in options:
        raise daemon_error(400, "expected multipart/form-data", "INVALID_REQUEST_BODY")
    parts: list[tuple[dict[str, str], bytes]] = []
    headers: dict[str, str] = {}
    field_buf, value_buf, data = bytearray(), bytearray(), bytearray()

    def on_part_begin() -> None:
        headers.clear()
        data.clear()

    def on_header_field(buf: bytes, start: int, end: int) -> None:
        field_buf.extend(buf[start:end])

    def on_header_value(buf: bytes, start: int, end: int) -> None:
        value_buf.extend(buf[start:end])

    def on_header_end() -> None:
        headers[field_buf.decode("latin-1").lower()] = value_buf.decode("utf-8", errors="replace")
        field_buf.clear()
        value_buf.clear()

    def on_part_data(buf: bytes, start: int, end: int) -> None:
        data.extend(buf[start:end])

    def on_part_end() -> None:
        _, params = parse_options_header(headers.get("content-disposition", ""))
        decoded = {k.decode("latin-1"): v.decode("utf-8", errors="replace") for k, v in params.items()}
        parts.append((decoded, bytes(data)))

    parser = MultipartParser(
        options[b"boundary"],
        callbacks={
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    parser.write(body)
    parser.finalize()
    return parts


def _disposition(name: str, path: str) -> str:
    quoted = path.replace("\\", "\\\\").replace('"', '\\"')
    encoded = urllib.parse.quote(path, safe="")
    return f'form-data; name="{name}"; filename="{quoted}"; filename*=utf-8\'\'{encoded}'


def _file_info(path: Path) -> FileInfo:
    st = path.lstat()
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    modified = datetime.fromtimestamp(st.st_mtime, UTC)
    return FileInfo(
        group=group,
        is_dir=stat.S_ISDIR(st.st_mode),
        mod_time=modified.strftime("%Y-%m-%d %H:%M:%S.%f +0000 UTC"),
        mode=stat.filemode(st.st_mode),
        modified_at=modified.isoformat().replace("+00:00", "Z"),
        name=path.name,
        owner=owner,
        path=str(path),
        permissions=oct(st.st_mode & 0o777)[2:].zfill(4),
        size=st.st_size,
    )


class Toolbox:
    def __init__(self, emu: DaytonaEmulator) -> None:
        self.emu = emu

    def register(self, router: Router, prefix: str) -> None:
        p = f"{prefix}/{{sid}}"
        r = router.add
        r("GET", f"{p}/version", self.version)
        r("GET", f"{p}/user-home-dir", self.home_dir)
        r("GET", f"{p}/work-dir", self.work_dir)
        r("POST", f"{p}/process/execute", self.execute)
        r("POST", f"{p}/process/session", self.create_session)
        r("GET", f"{p}/process/session", self.list_sessions)
        r("GET", f"{p}/process/session/{{session}}", self.get_session)
        r("DELETE", f"{p}/process/session/{{session}}", self.delete_session)
        r("POST", f"{p}/process/session/{{session}}/exec", self.session_exec)
        r("GET", f"{p}/process/session/{{session}}/command/{{cmd}}", self.get_command)
        r("GET", f"{p}/process/session/{{session}}/command/{{cmd}}/logs", self.command_logs)
        r("POST", f"{p}/files/folder", self.create_folder)
        r("DELETE", f"{p}/files", self.delete_file)
        r("GET", f"{p}/files", self.list_files)
        r("GET", f"{p}/files/info", self.file_info)
        r("GET", f"{p}/files/download", self.download_file)
        r("POST", f"{p}/files/bulk-download", self.bulk_download)
        r("POST", f"{p}/files/bulk-upload", self.bulk_upload)

    # ------------------------------------------------------------------ helpers
    def running(self, req: Request) -> EmulatedSandbox:
        sb = self.emu.sandbox(req.params["sid"], source=SOURCE_PROXY)
        with sb.lock:
            state = sb.state
            sb.last_activity = time.monotonic()
        if state != "started":
            raise HttpError(400, f"Sandbox {sb.id} is not running (state: {state})", source=SOURCE_PROXY)
        return sb

    def _session(self, sb: EmulatedSandbox, session_id: str) -> ShellSession:
        with sb.lock:
            session = sb.sessions.get(session_id)
        if session is None:
            raise daemon_error(404, f"session {session_id} not found", "PROCESS_NOT_FOUND")
        return session

    # --------------------------------------------------------------------- info
    def version(self, req: Request) -> Response:
        self.running(req)
        return json_response({"version": "emulator"})

    def home_dir(self, req: Request) -> Response:
        return json_response(UserHomeDirResponse(dir=str(self.running(req).home)))

    def work_dir(self, req: Request) -> Response:
        return json_response(WorkDirResponse(dir=str(self.running(req).work_dir)))

    # ------------------------------------------------------------------ process
    def execute(self, req: Request) -> Response:
        # apps/daemon/pkg/toolbox/process/execute/execute.go (ExecuteCommand): the command runs
        # in the shell GetShell() picks, fed on stdin (execute_linux.go, buildExecCmd); a
        # timeout answers 408 with the message below; exitCode is Go's ExitCode(), -1 when a
        # signal ended the shell.
        sb = self.running(req)
        spec: ExecuteRequest = _parse_model(ExecuteRequest, req)
        if not spec.command.strip():
            raise daemon_error(400, "empty command", "BAD_REQUEST")
        cwd = sb.resolve(spec.cwd, default=sb.work_dir)
        if not cwd.is_dir():
            return json_response(ExecuteResponse(exit_code=-1, result=f"chdir {spec.cwd}: no such file or directory"))
        limit = self.emu.max_exec_seconds
        timeout = float(spec.timeout) if spec.timeout and spec.timeout > 0 else limit
        outcome = run_command(
            spec.command,
            cwd=cwd,
            env=sb.process_env(spec.envs),
            timeout=min(timeout, limit),
            table=sb.processes,
            shell=sb.daemon_shell(),
        )
        if outcome.timed_out:
            raise daemon_error(
                408,
                f"Command execution timed out after {spec.timeout or int(limit)} seconds. The timeout can be "
                "increased by adjusting the timeout parameter in the request.",
                "REQUEST_TIMEOUT",  # common-go errors.NewRequestTimeoutError
            )
        return json_response(ExecuteResponse(exit_code=outcome.exit_code, result=outcome.output))

    def create_session(self, req: Request) -> Response:
        sb = self.running(req)
        spec: CreateSessionRequest = _parse_model(CreateSessionRequest, req)
        with sb.lock:
            if spec.session_id in sb.sessions:
                raise daemon_error(409, f"session {spec.session_id} already exists", "CONFLICT")
            sb.sessions[spec.session_id] = ShellSession(
                spec.session_id,
                cwd=sb.work_dir,
                env=sb.process_env(),
                state_dir=sb.state_dir / "sessions" / uuid.uuid4().hex,
                table=sb.processes,
                shell=sb.daemon_shell(),
            )
        return empty(201)

    def _exit_code(self, cmd) -> int | None:
        """The exit code as the daemon shows it: once its file is written, plus ``exit_status_delay``."""
        if cmd.finished_at is None or time.monotonic() - cmd.finished_at < self.emu.exit_status_delay:
            return None
        return cmd.exit_code

    def _logs(self, cmd) -> tuple[str, str]:
        """stdout and stderr; just after the exit code shows, the last bytes may not be there yet."""
        stdout, stderr = cmd.stdout(), cmd.stderr()
        hold = self.emu.output_after_exit
        if hold > 0 and cmd.finished_at is not None:
            if time.monotonic() - cmd.finished_at < self.emu.exit_status_delay + hold:
                cut = self.emu.held_output_bytes
                if stderr:
                    stderr = stderr.encode("utf-8")[:-cut].decode("utf-8", "ignore")
                else:
                    stdout = stdout.encode("utf-8")[:-cut].decode("utf-8", "ignore")
        return stdout, stderr

    def _session_model(self, session: ShellSession) -> Session:
        commands = [
            Command(id=c.id, command=c.command, exit_code=self._exit_code(c)) for c in list(session.commands.values())
        ]
        return Session(session_id=session.id, commands=commands)

    def list_sessions(self, req: Request) -> Response:
        sb = self.running(req)
        with sb.lock:
            sessions = list(sb.sessions.values())
        return json_response([self._session_model(s) for s in sessions])

    def get_session(self, req: Request) -> Response:
        sb = self.running(req)
        return json_response(self._session_model(self._session(sb, req.params["session"])))

    def delete_session(self, req: Request) -> Response:
        sb = self.running(req)
        session = self._session(sb, req.params["session"])
        with sb.lock:
            sb.sessions.pop(session.id, None)
        session.close()
        return empty(204)

    def session_exec(self, req: Request) -> Response:
        # apps/daemon/pkg/toolbox/process/session/execute.go (SessionExecuteCommand): the line
        # goes to the session shell's stdin; async answers 202 with the command id at once,
        # sync waits for the exit code file.
        sb = self.running(req)
        session = self._session(sb, req.params["session"])
        spec: SessionExecuteRequest = _parse_model(SessionExecuteRequest, req)
        if not spec.command.strip():
            raise daemon_error(400, "command cannot be empty", "BAD_REQUEST")
        cmd = session.execute(spec.command)
        if spec.run_async or spec.var_async:
            return json_response(SessionExecuteResponse(cmd_id=cmd.id), status=202)
        deadline = time.monotonic() + self.emu.max_exec_seconds
        if not cmd.done.wait(timeout=self.emu.max_exec_seconds):
            raise daemon_error(408, "session command did not finish in time", "PROCESS_EXECUTION_TIMEOUT")
        while self._exit_code(cmd) is None and cmd.exit_code is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the daemon polls the exit code file every 50 ms
        stdout, stderr = self._logs(cmd)
        return json_response(
            SessionExecuteResponse(
                cmd_id=cmd.id, exit_code=self._exit_code(cmd), output=stdout + stderr, stdout=stdout, stderr=stderr
            )
        )

    def _command(self, req: Request):
        sb = self.running(req)
        session = self._session(sb, req.params["session"])
        cmd = session.commands.get(req.params["cmd"])
        if cmd is None:
            raise daemon_error(404, f"command {req.params['cmd']} not found", "PROCESS_NOT_FOUND")
        return cmd

    def get_command(self, req: Request) -> Response:
        cmd = self._command(req)
        return json_response(Command(id=cmd.id, command=cmd.command, exit_code=self._exit_code(cmd)))

    def command_logs(self, req: Request) -> Response:
        if req.flag("follow"):
            raise daemon_error(400, "the emulator does not stream logs (follow=true)", "BAD_REQUEST")
        cmd = self._command(req)
        stdout, stderr = self._logs(cmd)
        return json_response(SessionCommandLogsResponse(output=stdout + stderr, stdout=stdout, stderr=stderr))

    # -------------------------------------------------------------------- files
    def create_folder(self, req: Request) -> Response:
        sb = self.running(req)
        path = sb.resolve(req.arg("path"))
        mode_raw = req.arg("mode") or "755"
        try:
            mode = int(mode_raw, 8)
        except ValueError as exc:
            raise daemon_error(400, f"invalid mode {mode_raw!r}", "BAD_REQUEST") from exc
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)
        return empty(201)

    def delete_file(self, req: Request) -> Response:
        sb = self.running(req)
        path = sb.resolve(req.arg("path"))
        if path == sb.root:
            raise daemon_error(403, "refusing to delete the sandbox home", "FILE_ACCESS_DENIED")
        if not path.exists() and not path.is_symlink():
            raise daemon_error(404, f"file not found: {req.arg('path')}", "FILE_NOT_FOUND")
        if path.is_dir() and not path.is_symlink():
            if not req.flag("recursive"):
                raise daemon_error(400, f"{req.arg('path')} is a directory; set recursive", "BAD_REQUEST")
            shutil.rmtree(path)
        else:
            path.unlink()
        return empty(204)

    def file_info(self, req: Request) -> Response:
        sb = self.running(req)
        path = sb.resolve(req.arg("path"))
        if not path.exists():
            raise daemon_error(404, f"file not found: {req.arg('path')}", "FILE_NOT_FOUND")
        return json_response(_file_info(path))

    def list_files(self, req: Request) -> Response:
        sb = self.running(req)
        path = sb.resolve(req.arg("path"), default=sb.work_dir)
        if not path.is_dir():
            raise daemon_error(404, f"directory not found: {req.arg('path')}", "FILE_NOT_FOUND")
        return json_response([_file_info(p) for p in sorted(path.iterdir())])

    def download_file(self, req: Request) -> Response:
        sb = self.running(req)
        path = sb.resolve(req.arg("path"))
        if not path.is_file():
            raise daemon_error(404, f"file not found: {req.arg('path')}", "FILE_NOT_FOUND")
        return Response(200, path.read_bytes(), "application/octet-stream")

    def bulk_download(self, req: Request) -> Response:
        sb = self.running(req)
        spec: FilesDownloadRequest = _parse_model(FilesDownloadRequest, req)
        boundary = uuid.uuid4().hex
        chunks: list[bytes] = []
        for requested in spec.paths:
            try:
                path = sb.resolve(requested)
                if path.is_dir():
                    raise daemon_error(400, f"{requested} is a directory", "INVALID_FILE_PATH")
                if not path.is_file():
                    raise daemon_error(404, f"file not found: {requested}", "FILE_NOT_FOUND")
                data, name, ctype = path.read_bytes(), "file", "application/octet-stream"
            except HttpError as err:
                payload = {"message": err.message, "statusCode": err.status, "code": err.code, "source": err.source}
                data, name, ctype = json.dumps(payload).encode(), "error", "application/json"
            head = (
                f"--{boundary}\r\nContent-Disposition: {_disposition(name, requested)}\r\nContent-Type: {ctype}\r\n\r\n"
            )
            chunks += [head.encode("utf-8"), data, b"\r\n"]
        chunks.append(f"--{boundary}--\r\n".encode())
        return Response(200, b"".join(chunks), f"multipart/form-data; boundary={boundary}")

    def bulk_upload(self, req: Request) -> Response:
        sb = self.running(req)
        parts = parse_multipart(req.headers.get("Content-Type", ""), req.body)
        paths: dict[str, str] = {}
        contents: dict[str, bytes] = {}
        for params, data in parts:
            name = params.get("name", "")
            if not name.startswith("files[") or "]." not in name:
                continue
            index, _, kind = name[len("files[") :].partition("].")
            if kind == "path":
                paths[index] = data.decode("utf-8")
            elif kind == "file":
                contents[index] = data
        missing = sorted(set(paths) ^ set(contents))
        if missing:
            return json_response(
                UploadFilesResponse(errors=[f"files[{i}] needs both path and file" for i in missing]), 400
            )
        # Resolve every destination first so a refused path leaves nothing half-written.
        targets = [
            (paths[i], sb.resolve(paths[i]), contents[i])
            for i in sorted(paths, key=lambda k: int(k) if k.isdigit() else k)
        ]
        results = []
        for requested, target, data in targets:
            if target.is_dir():
                raise daemon_error(400, f"{requested} is a directory", "INVALID_FILE_PATH")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            self.emu.uploaded_paths.append(requested)
            results.append(FsFileResult(path=requested, bytes=len(data)))
        return json_response(UploadFilesResponse(files=results))
