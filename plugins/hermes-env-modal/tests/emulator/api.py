"""The control-plane service (``modal.client.ModalClient``) as far as sandboxes need it.

Each handler takes the decoded request (and the grpclib stream, for metadata and
deadlines) and returns the response; unary-stream handlers are async generators.
Anything not defined here answers UNIMPLEMENTED and is recorded by the dispatcher.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from typing import TYPE_CHECKING

from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from .state import GENERIC, env_from_secret_sources

if TYPE_CHECKING:
    from .server import ModalEmulator

IMAGE_BUILDER_VERSION = "2025.06"


def make_jwt(claims: dict, lifetime: float = 3600.0) -> str:
    """An unsigned JWT: the client only decodes it to read ``exp``."""

    def b64(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    now = int(time.time())
    body = {"iat": now, "exp": now + int(lifetime), **claims}
    return f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(body)}.emulator"


def _image_metadata() -> api_pb2.ImageMetadata:
    v = sys.version_info
    return api_pb2.ImageMetadata(
        python_version_info=f"{v.major}.{v.minor}.{v.micro}",
        image_builder_version=IMAGE_BUILDER_VERSION,
    )


class ControlPlane:
    def __init__(self, emu: ModalEmulator) -> None:
        self.emu = emu
        self.store = emu._store

    # -- auth ----------------------------------------------------------------------------
    def check_auth(self, stream) -> None:
        md = stream.metadata or {}
        if (
            md.get("x-modal-token-id") != self.emu.token_id
            or md.get("x-modal-token-secret") != self.emu.token_secret
        ):
            raise GRPCError(Status.UNAUTHENTICATED, "emulator: invalid token id/secret")
        auth_token = md.get("x-modal-auth-token")
        if auth_token is not None and auth_token not in self.emu._issued_auth_tokens:
            raise GRPCError(
                Status.UNAUTHENTICATED, "emulator: unknown x-modal-auth-token"
            )

    async def ClientHello(self, req, stream):
        return api_pb2.ClientHelloResponse(image_builder_version=IMAGE_BUILDER_VERSION)

    async def AuthTokenGet(self, req, stream):
        token = make_jwt({"sub": "emulator-client"})
        self.emu._issued_auth_tokens.add(token)
        return api_pb2.AuthTokenGetResponse(token=token)

    # -- environments & apps ---------------------------------------------------------------
    async def EnvironmentGetOrCreate(self, req, stream):
        name = req.deployment_name or "main"
        return api_pb2.EnvironmentGetOrCreateResponse(
            environment_id="en-emulator" + name,
            metadata=api_pb2.EnvironmentMetadata(
                name=name,
                settings=api_pb2.EnvironmentSettings(
                    image_builder_version=IMAGE_BUILDER_VERSION
                ),
            ),
        )

    async def AppGetOrCreate(self, req, stream):
        create = (
            req.object_creation_type == api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING
        )
        app = self.store.app_get_or_create(
            req.app_name, req.environment_name or "main", create
        )
        if app is None:
            raise GRPCError(Status.NOT_FOUND, f"App '{req.app_name}' not found")
        return api_pb2.AppGetOrCreateResponse(app_id=app.id)

    async def AppHeartbeat(self, req, stream):
        return empty_pb2.Empty()

    async def AppClientDisconnect(self, req, stream):
        return empty_pb2.Empty()

    # -- images --------------------------------------------------------------------------
    async def ImageGetOrCreate(self, req, stream):
        rec = self.store.image_get_or_create(req.image)
        return api_pb2.ImageGetOrCreateResponse(
            image_id=rec.id,
            result=api_pb2.GenericResult(status=GENERIC.GENERIC_STATUS_SUCCESS),
            metadata=_image_metadata(),
        )

    async def ImageJoinStreaming(self, req, stream):
        if req.image_id not in self.store.images:
            raise GRPCError(Status.NOT_FOUND, f"Image {req.image_id} not found")
        yield api_pb2.ImageJoinStreamingResponse(
            result=api_pb2.GenericResult(status=GENERIC.GENERIC_STATUS_SUCCESS),
            metadata=_image_metadata(),
            eof=True,
        )

    async def ImageFromId(self, req, stream):
        if req.image_id not in self.store.images:
            raise GRPCError(Status.NOT_FOUND, f"Image {req.image_id} not found")
        return api_pb2.ImageFromIdResponse(
            image_id=req.image_id, metadata=_image_metadata()
        )

    async def ImageDelete(self, req, stream):
        # modal.experimental.image_delete -> ImageDeleteRequest{image_id}, answered with Empty.
        # "Deletion is irreversible and will prevent Functions/Sandboxes from using the Image"
        # (its docstring): ImageFromId and SandboxCreateV2 answer NOT_FOUND for it afterwards.
        try:
            self.store.delete_image(req.image_id)
        except LookupError as exc:
            raise GRPCError(Status.NOT_FOUND, str(exc)) from None
        return empty_pb2.Empty()

    # -- sandboxes (V2 control-plane RPCs) -------------------------------------------------
    def _sandbox(self, sandbox_id: str):
        sb = self.store.sandboxes.get(sandbox_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return sb

    def _router_access(self, sb) -> api_pb2.CommandRouterAccess:
        jwt = make_jwt(
            {"task_id": sb.task_id, "sandbox_id": sb.id},
            lifetime=self.emu.router_jwt_lifetime,
        )
        self.emu._issued_router_tokens[jwt] = sb.task_id
        return api_pb2.CommandRouterAccess(jwt=jwt, url=self.emu.router_url)

    async def SandboxCreateV2(self, req, stream):
        if req.app_id not in self.store.apps:
            raise GRPCError(Status.NOT_FOUND, f"App {req.app_id} not found")
        env = env_from_secret_sources(req.secret_sources)
        env.update(dict(req.definition.environment_variables.contents))
        try:
            sb = await self.store.create_sandbox(
                req.app_id, req.definition, env, lacks=frozenset(self.emu.image_lacks)
            )
        except LookupError as exc:  # a deleted image
            raise GRPCError(Status.NOT_FOUND, str(exc)) from None
        return api_pb2.SandboxCreateV2Response(
            sandbox_id=sb.id,
            task_id=sb.task_id,
            metadata=api_pb2.SandboxHandleMetadata(app_id=sb.app_id),
            command_router_access=self._router_access(sb),
        )

    async def SandboxGetTaskIdV2(self, req, stream):
        sb = self._sandbox(req.sandbox_id)
        resp = api_pb2.SandboxGetTaskIdResponse(task_id=sb.task_id)
        if sb.result is not None:
            resp.task_result.CopyFrom(sb.result)
        return resp

    async def SandboxGetCommandRouterAccess(self, req, stream):
        if req.WhichOneof("target") == "task_id":
            sandbox_id = self.store.tasks.get(req.task_id, "")
        else:
            sandbox_id = req.sandbox_id
        sb = self._sandbox(sandbox_id)
        if sb.result is not None:
            # The client maps this (ConflictError) to NotFoundError for a finished sandbox.
            raise GRPCError(
                Status.FAILED_PRECONDITION, f"Sandbox {sb.id} has already finished"
            )
        access = self._router_access(sb)
        return api_pb2.SandboxGetCommandRouterAccessResponse(
            jwt=access.jwt, url=access.url
        )

    async def SandboxWaitV2(self, req, stream):
        sb = self._sandbox(req.sandbox_id)
        # Long poll, capped below the client's per-attempt deadline (timeout + 5 s).
        await self.store.wait_done(sb, min(req.timeout, 50.0))
        resp = api_pb2.SandboxWaitResponse(
            metadata=api_pb2.SandboxHandleMetadata(app_id=sb.app_id)
        )
        if sb.result is not None:
            resp.result.CopyFrom(sb.result)
            resp.metadata.result.CopyFrom(sb.result)
        return resp

    async def SandboxWait(self, req, stream):
        # V1 RPC: the client uses it for ids of the V1 shape (sb- + 22 base62 chars), which
        # this emulator never issues; answering it keeps such lookups a clean NOT_FOUND.
        return await self.SandboxWaitV2(req, stream)

    async def SandboxTerminateV2(self, req, stream):
        sb = self._sandbox(req.sandbox_id)
        resp = api_pb2.SandboxTerminateResponse()
        if sb.result is not None:
            resp.existing_result.CopyFrom(sb.result)
        else:
            await self.store.finish(sb, GENERIC.GENERIC_STATUS_TERMINATED)
        return resp
