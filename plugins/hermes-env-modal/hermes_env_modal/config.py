"""Options of the modal backend, and which mode ("direct" or "managed") they select.

Imports neither the modal SDK nor an HTTP client: listing backends, printing
the config and choosing the mode all run where neither is installed.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from hermes_env_core.config import MemorySize, memory_bytes
from hermes_env_core.environment.options import EnvironmentConfig
from hermes_env_core.errors import ConfigError

__all__ = [
    "ModalConfig",
    "SyncMappingConfig",
    "default_snapshot_store",
    "gateway_auth_file",
    "gateway_url",
    "modal_credentials_source",
    "resolve_mode",
]

Mode = Literal["direct", "managed", "auto"]

#: Modal's longest sandbox life (Sandbox.create docs: timeout up to 24 hours).
MAX_SANDBOX_TIMEOUT_S = 24 * 3600
#: Where the seed system's managed gateway lives unless told otherwise
#: (hermes-agent tools/managed_tool_gateway.py: build_vendor_gateway_url).
DEFAULT_GATEWAY_DOMAIN = "nousresearch.com"


class SyncMappingConfig(BaseModel):
    """One host path mirrored in the sandbox (see ``hermes_env_core.sync.SyncMapping``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(..., min_length=1, description="A host directory or file.")
    remote: str = Field(..., min_length=1, description="Absolute, or relative to the sandbox home (~/x).")
    include: tuple[str, ...] = Field((), description="Globs to include (default: everything).")
    exclude: tuple[str, ...] | None = Field(None, description="Globs to exclude (default: .git, node_modules, ...).")
    upload_only: bool = Field(False, description="Pushed but never pulled back (credentials).")


def memory_mib(size: str) -> int:
    """A ``memory`` option in MiB, as Modal takes it (rounded up)."""
    return -(-memory_bytes(size) // (1 << 20))


class ModalConfig(EnvironmentConfig):
    """Options of the modal backend.

    ``mode`` picks how sandboxes are reached: ``direct`` drives the modal SDK
    with this machine's Modal token; ``managed`` talks to an HTTP gateway that
    holds the Modal credentials; ``auto`` (the default) takes ``managed`` when
    a gateway token is configured, else ``direct`` when Modal credentials exist.
    """

    mode: Mode = Field("auto", description="direct | managed | auto (managed if a gateway token is set).")

    # -- direct ------------------------------------------------------------------
    token_id: SecretStr | None = Field(None, description="Modal token id (else MODAL_TOKEN_ID or ~/.modal.toml).")
    token_secret: SecretStr | None = Field(None, description="Modal token secret (else MODAL_TOKEN_SECRET).")
    app_name: str = Field("hermes-env", min_length=1, description="Modal app the sandboxes belong to.")
    image: str | None = Field(None, description="Registry image, e.g. 'python:3.12-slim' (default: Modal's debian_slim).")
    image_id: str | None = Field(None, description="An existing Modal image id (im-...); wins over image.")
    workdir: str | None = Field(None, description="Working directory the sandbox starts in.")
    cpu: float | None = Field(None, gt=0, description="CPU cores requested.")
    memory: MemorySize | None = Field(None, description="Memory requested, such as '2g' or '512m'.")
    region: str | None = Field(None, description="Region to run the sandbox in.")
    block_network: bool = Field(False, description="Cut the sandbox off from the network.")
    sandbox_timeout: int = Field(
        3600, gt=0, le=MAX_SANDBOX_TIMEOUT_S, description="Longest life of one sandbox, seconds (Modal's limit: 24 h)."
    )
    idle_timeout: int | None = Field(None, gt=0, description="Seconds idle before Modal ends the sandbox.")
    start_timeout: float = Field(
        600.0, gt=0, description="Seconds to connect and create the sandbox (a first image build takes minutes)."
    )
    image_check_timeout: float = Field(
        120.0, gt=0, description="Seconds for the first command in a new sandbox (the image check) to answer."
    )
    snapshot_timeout: int = Field(120, gt=0, description="Seconds snapshot_filesystem may take at close.")
    snapshot_ttl: int | None = Field(
        30 * 24 * 3600, gt=0, description="Seconds Modal keeps a snapshot (Modal's default: 30 days; None: for ever)."
    )
    recreate: bool = Field(True, description="Start a new sandbox when the old one ended (timeout, terminate).")
    state_dir: str | None = Field(None, description="Sandbox directory for session files (default /dev/shm, else /tmp).")

    # -- persistence ---------------------------------------------------------------
    persistent: bool = Field(False, description="Snapshot the filesystem at close; restore it by task_id.")
    snapshot_store: str | None = Field(None, description="JSON file of snapshot ids by task id.")

    # -- file sync -------------------------------------------------------------------
    sync: tuple[SyncMappingConfig, ...] = Field((), description="Host paths pushed before each command.")
    sync_interval_s: float = Field(5.0, ge=0, description="Seconds between change checks of the synced trees.")
    pull_on_close: bool = Field(True, description="Bring the sandbox's changes back at close.")
    credential_files: tuple[str, ...] = Field(
        (), description="Host files copied into the sandbox, never pulled back (direct mode only)."
    )

    # -- managed -------------------------------------------------------------------
    gateway_url: str | None = Field(
        None,
        description="Base URL of the managed gateway (else MODAL_GATEWAY_URL, else "
        "TOOL_GATEWAY_SCHEME://modal-gateway.TOOL_GATEWAY_DOMAIN, default https://modal-gateway.nousresearch.com).",
    )
    gateway_token: SecretStr | None = Field(
        None, description="Bearer token for the gateway (else TOOL_GATEWAY_USER_TOKEN, else gateway_auth_file)."
    )
    gateway_auth_file: str | None = Field(
        None,
        description="JSON auth store holding providers.nous.access_token/expires_at, re-read when the token "
        "expires (default $HERMES_HOME/auth.json, HERMES_HOME defaulting to ~/.hermes).",
    )
    connect_timeout: float = Field(10.0, gt=0, description="Seconds to connect to the gateway.")
    read_timeout: float = Field(60.0, gt=0, description="Seconds to wait for one gateway response.")
    gateway_retries: int = Field(3, ge=0, description="Retries of a failed gateway call (same idempotency key).")

    @field_validator("sync", mode="before")
    @classmethod
    def _one_mapping_is_a_list(cls, value: object) -> object:
        return (value,) if isinstance(value, Mapping) else value

    @field_validator("gateway_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"gateway_url must start with http:// or https://, got {value!r}")
        return value.rstrip("/") if value else value

    @model_validator(mode="after")
    def _persistence_needs_a_name(self) -> ModalConfig:
        if self.persistent and not self.task_id:
            raise ValueError(
                "persistent = true needs a task_id: snapshots are found again by it (pass task_id=...)"
            )
        return self

    def sync_mappings(self):  # -> list[SyncMapping]
        """The ``sync`` and ``credential_files`` options as the sync engine's records."""
        from hermes_env_core.sync import SyncMapping

        out = []
        for m in self.sync:
            kw = {} if m.exclude is None else {"exclude": m.exclude}
            out.append(SyncMapping(m.host, m.remote, include=m.include, upload_only=m.upload_only, **kw))
        home = Path.home()
        for raw in self.credential_files:
            host = Path(raw).expanduser()
            try:
                remote = host.resolve().relative_to(home.resolve()).as_posix()
            except ValueError:
                remote = host.resolve().as_posix()
            out.append(SyncMapping(str(host), remote, exclude=(), upload_only=True))
        return out


def default_snapshot_store() -> Path:
    """``$XDG_STATE_HOME/hermes-env/modal-snapshots.json`` (``~/.local/state`` by default)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "hermes-env" / "modal-snapshots.json"


def modal_credentials_source(config: ModalConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """Where Modal token credentials would come from, or None if nowhere.

    Mirrors the SDK's lookup without importing it: the config, then
    ``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET``, then the active profile of
    ``~/.modal.toml`` (``MODAL_CONFIG_PATH``, ``MODAL_PROFILE``).
    """
    env = os.environ if environ is None else environ
    if config.token_id is not None and config.token_secret is not None:
        return "the token_id and token_secret options"
    if env.get("MODAL_TOKEN_ID") and env.get("MODAL_TOKEN_SECRET"):
        return "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
    path = Path(env.get("MODAL_CONFIG_PATH") or os.path.join(os.path.expanduser("~"), ".modal.toml"))
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    profiles = {k: v for k, v in data.items() if isinstance(v, dict)}
    name = env.get("MODAL_PROFILE") or next((k for k, v in profiles.items() if v.get("active")), "default")
    profile = profiles.get(name, {})
    if profile.get("token_id") and profile.get("token_secret"):
        return f"profile {name!r} of {path}"
    return None


def gateway_url(config: ModalConfig, environ: Mapping[str, str] | None = None) -> str:
    """The managed gateway's base URL, found as the seed system finds it.

    The ``gateway_url`` option, else ``MODAL_GATEWAY_URL``, else
    ``$TOOL_GATEWAY_SCHEME://modal-gateway.$TOOL_GATEWAY_DOMAIN`` (https and
    nousresearch.com by default) -- hermes-agent's
    ``tools/managed_tool_gateway.py`` (``build_vendor_gateway_url("modal")``).
    """
    env = os.environ if environ is None else environ
    if config.gateway_url:
        return config.gateway_url
    explicit = env.get("MODAL_GATEWAY_URL", "").strip().rstrip("/")
    if explicit:
        if not explicit.startswith(("http://", "https://")):
            raise ConfigError(f"modal: MODAL_GATEWAY_URL must start with http:// or https://, got {explicit!r}")
        return explicit
    scheme = env.get("TOOL_GATEWAY_SCHEME", "").strip().lower() or "https"
    if scheme not in ("http", "https"):
        raise ConfigError(f"modal: TOOL_GATEWAY_SCHEME must be 'http' or 'https', got {scheme!r}")
    domain = env.get("TOOL_GATEWAY_DOMAIN", "").strip().strip("/") or DEFAULT_GATEWAY_DOMAIN
    return f"{scheme}://modal-gateway.{domain}"


def gateway_auth_file(config: ModalConfig, environ: Mapping[str, str] | None = None) -> Path:
    """The auth store a gateway token is read from: the option, else ``$HERMES_HOME/auth.json``."""
    env = os.environ if environ is None else environ
    if config.gateway_auth_file:
        return Path(config.gateway_auth_file).expanduser()
    home = env.get("HERMES_HOME") or os.path.join(os.path.expanduser("~"), ".hermes")
    return Path(home).expanduser() / "auth.json"


def explicit_gateway_token(config: ModalConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """A gateway token given outright: the option, else ``TOOL_GATEWAY_USER_TOKEN``."""
    env = os.environ if environ is None else environ
    if config.gateway_token is not None:
        return config.gateway_token.get_secret_value()
    token = env.get("TOOL_GATEWAY_USER_TOKEN", "").strip()
    return token or None


_HOW_TO_FIX = (
    "Either use a managed gateway: set gateway_token (an option of the modal backend, e.g. "
    "TERMINAL_GATEWAY_TOKEN or [terminal.modal] in hermes-env.toml, or TOOL_GATEWAY_USER_TOKEN) and, "
    "unless it is the default one, gateway_url (or MODAL_GATEWAY_URL); "
    "or give this machine Modal credentials: run `modal token new` (writes ~/.modal.toml), or set "
    "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET."
)


def resolve_mode(config: ModalConfig, environ: Mapping[str, str] | None = None) -> Literal["direct", "managed"]:
    """The mode ``config`` selects; ``auto`` is decided here. Raises ``ConfigError``."""
    mode = config.mode
    if mode == "auto":
        if explicit_gateway_token(config, environ) is not None:
            mode = "managed"
        elif modal_credentials_source(config, environ) is not None:
            mode = "direct"
        else:
            raise ConfigError(
                "modal: mode 'auto' found neither a gateway token nor Modal credentials. " + _HOW_TO_FIX
            )
    if mode == "managed":
        gateway_url(config, environ)  # raises on a malformed variable
        if explicit_gateway_token(config, environ) is None:
            store = gateway_auth_file(config, environ)
            if not store.is_file():
                raise ConfigError(
                    "modal: managed mode needs a gateway token: set the gateway_token option "
                    "(TERMINAL_GATEWAY_TOKEN), or TOOL_GATEWAY_USER_TOKEN, or log in so that "
                    f"{store} holds providers.nous.access_token"
                )
    return mode  # type: ignore[return-value]


def credentials_missing_message() -> str:
    return "modal: no Modal credentials found. " + _HOW_TO_FIX
