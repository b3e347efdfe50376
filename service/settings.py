"""One Settings object, read from `OPTLAB_*` environment variables; invalid values fail fast."""

from __future__ import annotations

import sys
from functools import cached_property
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OPTLAB_", extra="ignore")

    data_dir: Path = Field(default=Path(".optlab"), description="job folders, SQLite files, artifacts")
    database_url: str = Field(default="", description="SQLAlchemy URL; default SQLite in data_dir")
    mlflow_tracking_uri: str = Field(default="http://127.0.0.1:5000")
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    mlflow_host: str = "127.0.0.1"
    mlflow_port: int = Field(default=5000, ge=1, le=65535)
    max_steps: int = Field(default=1_000_000, ge=1, description="cap on a job's `steps`")
    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    poll_interval_s: float = Field(default=0.5, gt=0, le=60)
    cancel_grace_s: float = Field(default=5.0, gt=0, le=300, description="SIGTERM -> SIGKILL delay")
    catalogue_timeout_s: float = Field(default=300.0, gt=0)
    job_python: str = Field(default=sys.executable, description="interpreter that runs jobs")
    plugin_poll_s: float = Field(
        default=2.0, gt=0, le=3600, description="how often a worker looks for changed plugin files"
    )

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _http_only(cls, value: str) -> str:
        # Workers reach MLflow over HTTP only, never through its database.
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http(s):// URL of a tracking server; received {value!r}")
        return value.rstrip("/")

    @cached_property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'optlab.db').resolve()}"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"
