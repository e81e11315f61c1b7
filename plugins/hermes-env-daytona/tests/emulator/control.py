"""Control-plane routes (``{api_url}/sandbox...``), the part the SDK's ``SandboxApi`` calls.

Requests are parsed with the generated request models (``CreateSandbox``,
``SandboxLabels``) and answered with the generated response models
(``Sandbox``, ``ListSandboxesResponse``, ``ToolboxProxyUrl``), so a field the
SDK renames or makes required breaks the emulator's own tests.
"""

from __future__ import annotations

import base64
import json
import re
from typing import TYPE_CHECKING

from daytona_api_client import CreateSandbox, ListSandboxesResponse, SandboxLabels, ToolboxProxyUrl

from .errors import HttpError
from .sandboxes import DEFAULT_SNAPSHOT, DEFAULT_TARGET, DEFAULT_USER, EmulatedSandbox
from .wire import Request, Response, Router, json_response

if TYPE_CHECKING:
    from .emulator import DaytonaEmulator

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _image_from_dockerfile(dockerfile: str) -> str | None:
    for line in dockerfile.splitlines():
        parts = line.strip().split()
        if len(parts) >= 2 and parts[0].upper() == "FROM":
            return parts[1]
    return None


def _encode_cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(str(offset).encode()).decode()


def _decode_cursor(cursor: str | None) -> int:
    if not cursor:
        return 0
    try:
        return int(base64.urlsafe_b64decode(cursor.encode()).decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(400, "invalid cursor") from exc


class ControlPlane:
    def __init__(self, emu: DaytonaEmulator) -> None:
        self.emu = emu

    def register(self, router: Router, prefix: str) -> None:
        r = router.add
        r("POST", f"{prefix}/sandbox", self.create)
        r("GET", f"{prefix}/sandbox", self.list)
        r("GET", f"{prefix}/sandbox/{{sid}}", self.get)
        r("DELETE", f"{prefix}/sandbox/{{sid}}", self.delete)
        r("POST", f"{prefix}/sandbox/{{sid}}/start", self.start)
        r("POST", f"{prefix}/sandbox/{{sid}}/stop", self.stop)
        r("POST", f"{prefix}/sandbox/{{sid}}/archive", self.archive)
        r("POST", f"{prefix}/sandbox/{{sid}}/pause", self.pause)
        r("POST", f"{prefix}/sandbox/{{sid}}/recover", self.recover)
        r("GET", f"{prefix}/sandbox/{{sid}}/toolbox-proxy-url", self.toolbox_proxy_url)
        r("PUT", f"{prefix}/sandbox/{{sid}}/labels", self.replace_labels)
        r("POST", f"{prefix}/sandbox/{{sid}}/autostop/{{interval}}", self.interval("auto_stop_interval"))
        r("POST", f"{prefix}/sandbox/{{sid}}/autoarchive/{{interval}}", self.interval("auto_archive_interval"))
        r("POST", f"{prefix}/sandbox/{{sid}}/autodelete/{{interval}}", self.interval("auto_delete_interval"))

    # ------------------------------------------------------------------ helpers
    def _dto(self, sb: EmulatedSandbox) -> Response:
        with sb.lock:
            return json_response(sb.to_dto(self.emu.advertised_toolbox_url))

    def _lookup(self, req: Request) -> EmulatedSandbox:
        return self.emu.sandbox(req.params["sid"])

    # ------------------------------------------------------------------- routes
    def create(self, req: Request) -> Response:
        body = req.json()
        if not isinstance(body, dict):
            raise HttpError(400, "body must be a JSON object")
        try:
            spec = CreateSandbox.from_dict(body)
        except Exception as exc:  # pydantic ValidationError: the API answers 400
            raise HttpError(400, f"invalid CreateSandbox: {exc}") from exc
        assert spec is not None
        if spec.name is not None and not _NAME_RE.match(spec.name):
            raise HttpError(400, f"invalid sandbox name: {spec.name!r}")

        dockerfile = spec.build_info.dockerfile_content if spec.build_info else None
        snapshot = spec.snapshot
        if dockerfile is not None:
            snapshot = _image_from_dockerfile(dockerfile) or snapshot
        cpu = spec.cpu if spec.cpu is not None else 1
        with self.emu.lock:
            if spec.name is not None and self.emu.find(spec.name) is not None:
                raise HttpError(409, f"Sandbox with name {spec.name} already exists")
            self.emu.check_quota(cpu)
            sb = EmulatedSandbox.new(
                self.emu.root,
                name=spec.name,
                user=spec.user or DEFAULT_USER,
                snapshot=snapshot or DEFAULT_SNAPSHOT,
                dockerfile=dockerfile,
                env=dict(spec.env or {}),
                labels=dict(spec.labels or {}),
                public=bool(spec.public),
                target=spec.target or DEFAULT_TARGET,
                cpu=cpu,
                gpu=spec.gpu or 0,
                memory=spec.memory if spec.memory is not None else 1,
                disk=spec.disk if spec.disk is not None else 3,
                auto_stop_interval=spec.auto_stop_interval if spec.auto_stop_interval is not None else 15,
                auto_archive_interval=spec.auto_archive_interval if spec.auto_archive_interval is not None else 10080,
                auto_delete_interval=spec.auto_delete_interval if spec.auto_delete_interval is not None else -1,
                network_block_all=bool(spec.network_block_all),
                create_request=body,
                profile=self.emu.profile_of(snapshot or DEFAULT_SNAPSHOT),
            )
            self.emu.add(sb)
        forced = self.emu.pop_create_state()
        if forced is not None:
            state, reason = forced
            self.emu.set_state(sb, state, reason=reason)
        else:
            self.emu.transition(sb, via="creating", final="started")
        return self._dto(sb)

    def get(self, req: Request) -> Response:
        return self._dto(self._lookup(req))

    def list(self, req: Request) -> Response:
        labels: dict[str, str] = {}
        raw_labels = req.arg("labels")
        if raw_labels:
            try:
                labels = json.loads(raw_labels)
            except ValueError as exc:
                raise HttpError(400, "labels must be a JSON object") from exc
            if not isinstance(labels, dict):
                raise HttpError(400, "labels must be a JSON object")
        states = set(req.args("states"))
        id_prefix = (req.arg("id") or "").lower()
        name_prefix = (req.arg("name") or "").lower()
        limit_raw = req.arg("limit")
        limit = int(limit_raw) if limit_raw else 100
        if limit < 1:
            raise HttpError(400, "limit must be a positive integer")
        offset = _decode_cursor(req.arg("cursor"))

        matched = []
        for sb in self.emu.all_sandboxes():
            with sb.lock:
                if any(sb.labels.get(k) != v for k, v in labels.items()):
                    continue
                if states and sb.state not in states:
                    continue
                if id_prefix and not sb.id.lower().startswith(id_prefix):
                    continue
                if name_prefix and not sb.name.lower().startswith(name_prefix):
                    continue
                matched.append(sb)
        matched.sort(key=lambda s: s.created_at, reverse=req.arg("order", "desc") != "asc")
        page = matched[offset : offset + limit]
        next_cursor = _encode_cursor(offset + limit) if offset + limit < len(matched) else None
        items = []
        for sb in page:
            with sb.lock:
                items.append(sb.to_list_item(self.emu.advertised_toolbox_url))
        return json_response(ListSandboxesResponse(items=items, next_cursor=next_cursor))

    def start(self, req: Request) -> Response:
        sb = self._lookup(req)
        with sb.lock:
            state = sb.state
        if state in ("error", "build_failed"):
            raise HttpError(400, f"Sandbox {sb.id} is in an errored state and cannot be started")
        # An archived sandbox's filesystem comes back from object storage first
        # (docs: "starting an archived sandbox takes more time"); a paused one resumes.
        if state in ("stopped", "archived", "paused"):
            via = {"stopped": "starting", "archived": "restoring", "paused": "resuming"}[state]
            self.emu.transition(sb, via=via, final="started")
        elif state in ("stopping", "archiving", "pausing"):
            # The API refuses a start while a sandbox is on its way down: wait for it to settle.
            raise HttpError(409, f"Sandbox {sb.id} is {state}; wait until it has finished")
        elif state not in ("started", "starting", "creating", "restoring", "resuming"):
            raise HttpError(409, f"Sandbox {sb.id} cannot be started from state {state}")
        return self._dto(sb)

    def stop(self, req: Request) -> Response:
        sb = self._lookup(req)
        with sb.lock:
            state = sb.state
        if state in ("started", "starting", "creating"):
            sb.kill_processes()
            if sb.auto_delete_interval == 0:
                self.emu.destroy(sb)
            else:
                self.emu.transition(sb, via="stopping", final="stopped")
        elif state not in ("stopped", "stopping"):
            raise HttpError(409, f"Sandbox {sb.id} cannot be stopped from state {state}")
        return self._dto(sb)

    def archive(self, req: Request) -> Response:
        sb = self._lookup(req)
        with sb.lock:
            state = sb.state
        if state != "stopped":
            raise HttpError(400, f"Sandbox {sb.id} must be stopped before it can be archived")
        self.emu.transition(sb, via="archiving", final="archived")
        return self._dto(sb)

    def pause(self, req: Request) -> Response:
        sb = self._lookup(req)
        with sb.lock:
            state = sb.state
        if state != "started":
            raise HttpError(400, f"Sandbox {sb.id} must be started to be paused")
        self.emu.transition(sb, via="pausing", final="paused")
        return self._dto(sb)

    def recover(self, req: Request) -> Response:
        sb = self._lookup(req)
        with sb.lock:
            state, recoverable = sb.state, sb.recoverable
        if state != "error" or not recoverable:
            raise HttpError(400, f"Sandbox {sb.id} is not in a recoverable error state")
        self.emu.transition(sb, via="starting", final="started")
        return self._dto(sb)

    def delete(self, req: Request) -> Response:
        sb = self._lookup(req)
        self.emu.destroy(sb)
        return self._dto(sb)

    def toolbox_proxy_url(self, req: Request) -> Response:
        self._lookup(req)
        return json_response(ToolboxProxyUrl(url=self.emu.toolbox_url))

    def replace_labels(self, req: Request) -> Response:
        sb = self._lookup(req)
        try:
            labels = SandboxLabels.from_dict(req.json())
        except HttpError:
            raise
        except Exception as exc:
            raise HttpError(400, f"invalid labels: {exc}") from exc
        assert labels is not None
        with sb.lock:
            sb.labels = dict(labels.labels)
            return json_response(SandboxLabels(labels=dict(sb.labels)))

    def interval(self, attr: str):
        def handler(req: Request) -> Response:
            sb = self._lookup(req)
            try:
                value = int(req.params["interval"])
            except ValueError as exc:
                raise HttpError(400, "interval must be an integer") from exc
            with sb.lock:
                setattr(sb, attr, value)
            return self._dto(sb)

        return handler
