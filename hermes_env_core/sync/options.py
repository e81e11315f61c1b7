"""The sync settings a remote backend's config accepts, validated where users type them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .filters import DEFAULT_EXCLUDES
from .mapping import SyncMapping

__all__ = ["SyncOption"]


class SyncOption(BaseModel):
    """One host path mirrored into the target: pushed before commands, pulled back at close."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(..., min_length=1, description="Directory or file on this machine.")
    remote: str = Field(..., min_length=1, description="Where it lives in the target (absolute, or below home).")
    include: tuple[str, ...] = Field((), description="Only paths matching these globs.")
    exclude: tuple[str, ...] = Field(DEFAULT_EXCLUDES, description="Paths never synced.")
    upload_only: bool = Field(False, description="Pushed but never pulled back (credentials).")

    def mapping(self) -> SyncMapping:
        return SyncMapping(self.host, self.remote, self.include, self.exclude, self.upload_only)
