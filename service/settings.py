"""One Settings object, read from `OPTLAB_*` environment variables; invalid values fail fast."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobs.data_roots import parse_data_roots
from service.secrets import redact_url

TOKEN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MIN_TOKEN_CHARS = 16
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ApiToken:
    """One configured API token. `secret` is never logged, shown or put in an error message."""

    name: str
    secret: str = ""
    can_write: bool = True

    def __repr__(self) -> str:  # a stray log of the object must not print the secret
        return f"ApiToken(name={self.name!r}, can_write={self.can_write})"


def parse_tokens(lines: list[str], source: str) -> list[ApiToken]:
    """`NAME:TOKEN` (submit and cancel) or `NAME:TOKEN:read` entries; ValueError names the entry
    by its position and name, never by its secret."""
    tokens: list[ApiToken] = []
    for number, entry in enumerate((line.strip() for line in lines), start=1):
        if not entry or entry.startswith("#"):
            continue
        name, _, rest = entry.partition(":")
        secret, _, scope = rest.partition(":")
        where = f"{source} entry {number}"
        if not TOKEN_NAME_PATTERN.match(name):
            raise ValueError(
                f"{where}: the name must be 1-64 of A-Z a-z 0-9 _ . - before the first ':' "
                "(entries are NAME:TOKEN or NAME:TOKEN:read)"
            )
        if scope not in ("", "read") or ":" in scope:
            raise ValueError(f"{where} ({name!r}): the scope after the token may only be 'read'")
        if len(secret) < MIN_TOKEN_CHARS or any(c.isspace() or ord(c) < 32 for c in secret):
            raise ValueError(
                f"{where} ({name!r}): the token must be at least {MIN_TOKEN_CHARS} characters, "
                "no spaces or control characters (make one: "
                "`python -c 'import secrets; print(secrets.token_urlsafe())'`)"
            )
        if any(t.name == name for t in tokens):
            raise ValueError(f"{where}: the name {name!r} is given twice")
        if any(t.secret == secret for t in tokens):
            raise ValueError(f"{where} ({name!r}): the same token is given to another name")
        tokens.append(ApiToken(name=name, secret=secret, can_write=scope != "read"))
    return tokens


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting may be a token or a URL with a password in it.
    model_config = SettingsConfigDict(env_prefix="OPTLAB_", extra="ignore", hide_input_in_errors=True)

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
    # Access control (see README "Access control"); the secrets stay out of repr and messages.
    api_tokens: str = Field(default="", repr=False, description="comma-separated NAME:TOKEN[:read]")
    api_tokens_file: Path | None = Field(default=None, description="the same entries, one per line")
    trusted_hosts: str = Field(
        default=",".join(LOOPBACK_HOSTS), description="comma-separated Host names the API answers; * any"
    )
    max_queued: int = Field(default=1000, ge=1, description="queued jobs in total")
    max_queued_per_token: int = Field(default=100, ge=1, description="queued jobs per token name")
    data_roots: str = Field(
        default="",
        description="folders workloads may read data files from (npz, char_lm's text_file), separated "
        "by ':' like PATH; passed on to job processes",
    )
    max_study_jobs: int = Field(default=200, ge=1, description="jobs one study may expand to")
    # Durable jobs (README "Workers"): lease, heartbeat and limits; the API reads them too.
    lease_s: float = Field(
        default=15.0, gt=0, le=3600, description="a dead worker's job is taken over after this"
    )
    heartbeat_s: float = Field(default=5.0, gt=0, description="lease renewal cadence; under lease_s / 2")
    max_job_seconds: float = Field(default=86400.0, gt=0, description="cap on (and default of) timeout_s")
    job_memory_mb: int | None = Field(default=None, gt=0, description="RSS limit per job (all its processes)")
    job_retries: int = Field(
        default=2,
        ge=0,
        le=100,
        description="times a job whose process was killed from outside (out of memory) is started again",
    )
    job_log_mb: float = Field(
        default=64, gt=0, description="a job's log.txt is cut back to its start and latest output over this"
    )
    job_threads: int | None = Field(
        default=None, gt=0, description="CPU threads per job; default: the worker's cores // its slots"
    )
    warm_pool: bool = Field(
        default=True, description="pre-start one job process per slot with its framework imported"
    )
    queue_for_absent_devices: bool = Field(
        default=False, description="accept jobs for devices no live worker offers (they wait for one)"
    )
    _tokens: list[ApiToken] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> Settings:
        # Two renewals fit in one lease, so one lost write never costs the lease.
        if self.heartbeat_s >= self.lease_s / 2:
            raise ValueError(
                f"OPTLAB_HEARTBEAT_S must be under OPTLAB_LEASE_S / 2 ({self.lease_s / 2:g}); "
                f"received {self.heartbeat_s:g}"
            )
        return self

    @model_validator(mode="after")
    def _read_tokens(self) -> Settings:
        tokens = parse_tokens(self.api_tokens.split(","), "OPTLAB_API_TOKENS")
        if self.api_tokens_file is not None:
            try:
                lines = self.api_tokens_file.read_text().splitlines()
            except OSError as exc:
                raise ValueError(
                    f"OPTLAB_API_TOKENS_FILE: cannot read {self.api_tokens_file}: {exc.strerror}"
                ) from None
            tokens += parse_tokens(lines, f"OPTLAB_API_TOKENS_FILE {self.api_tokens_file}")
        names = [t.name for t in tokens]
        if len(set(names)) < len(names) or len({t.secret for t in tokens}) < len(tokens):
            raise ValueError("OPTLAB_API_TOKENS and OPTLAB_API_TOKENS_FILE give one name or token twice")
        self._tokens = tokens
        return self

    @property
    def tokens(self) -> list[ApiToken]:
        """Configured tokens; empty: the API is open (and must listen on localhost only)."""
        return self._tokens

    @property
    def data_root_paths(self) -> list[Path]:
        return parse_data_roots(self.data_roots)

    @property
    def trusted_host_names(self) -> list[str]:
        return [h.strip().lower() for h in self.trusted_hosts.split(",") if h.strip()]

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _http_only(cls, value: str) -> str:
        # Workers reach MLflow over HTTP only, never through its database.
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                f"must be an http(s):// URL of a tracking server; received {redact_url(value)!r}"
            )
        return value.rstrip("/")

    @cached_property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'optlab.db').resolve()}"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"
