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
# Tokens asked for and none given must not open the API: it would run without access control.
_NO_ENTRIES = (
    "{what} holds no NAME:TOKEN entry: give one, or unset it to run the API open (on localhost only)"
)


@dataclass(frozen=True)
class ApiToken:
    """One configured API token. `secret` is never logged, shown or put in an error message."""

    name: str
    secret: str = ""
    can_write: bool = True

    def __repr__(self) -> str:  # a stray log of the object must not print the secret
        return f"ApiToken(name={self.name!r}, can_write={self.can_write})"


def token_names(tokens: list[ApiToken]) -> str:
    """`alice (submit), dash (read-only)`: who may use the API, never a secret."""
    return ", ".join(f"{t.name} ({'submit' if t.can_write else 'read-only'})" for t in tokens)


@dataclass(frozen=True)
class TokenEntry:
    """A parsed token entry and where it was written, for messages that name the place only."""

    where: str  # "OPTLAB_API_TOKENS entry 2", "OPTLAB_API_TOKENS_FILE /run/t line 4"
    token: ApiToken


# A space then `#` starts a comment: a token holds no spaces, so nothing of one is lost.
TRAILING_COMMENT = re.compile(r"\s+#.*$")


def parse_tokens(lines: list[str], source: str, unit: str = "entry") -> list[TokenEntry]:
    """`NAME:TOKEN` (submit and cancel) or `NAME:TOKEN:read` entries. A ValueError names an entry by
    its place only, never by what it holds: the commonest mistakes (a token without its name, name
    and token swapped) put the secret where the name belongs."""
    entries: list[TokenEntry] = []
    for number, line in enumerate(lines, start=1):
        entry = TRAILING_COMMENT.sub("", line).strip()
        if not entry or entry.startswith("#"):
            continue
        where = f"{source} {unit} {number}"
        name, separator, rest = entry.partition(":")
        secret, _, scope = rest.partition(":")
        if not separator:
            raise ValueError(f"{where} has no ':': entries are NAME:TOKEN or NAME:TOKEN:read")
        if not TOKEN_NAME_PATTERN.match(name):
            raise ValueError(
                f"{where}: the name must be 1-64 of A-Z a-z 0-9 _ . - before the first ':' "
                "(entries are NAME:TOKEN or NAME:TOKEN:read)"
            )
        if scope not in ("", "read"):
            raise ValueError(f"{where}: the scope after the token may only be 'read' (or nothing)")
        # Printable ASCII only: HTTP clients encode other characters in a header differently
        # (UTF-8, Latin-1, or not at all), so such a token would match for some clients only.
        if len(secret) < MIN_TOKEN_CHARS or not all(33 <= ord(c) <= 126 for c in secret):
            raise ValueError(
                f"{where}: the token must be at least {MIN_TOKEN_CHARS} printable ASCII characters, "
                "without spaces (make one: `python -c 'import secrets; print(secrets.token_urlsafe())'`)"
            )
        entries.append(TokenEntry(where, ApiToken(name=name, secret=secret, can_write=scope != "read")))
    return entries


def _refuse_repeats(entries: list[TokenEntry]) -> None:
    for index, later in enumerate(entries):
        for earlier in entries[:index]:
            if earlier.token.name == later.token.name:
                raise ValueError(f"{later.where} gives the name of {earlier.where} again")
            if earlier.token.secret == later.token.secret:
                raise ValueError(f"{later.where} gives the token of {earlier.where} again")


def _read_token_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is not part of a name
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"OPTLAB_API_TOKENS_FILE {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start})"
        ) from None
    except OSError as exc:
        raise ValueError(f"OPTLAB_API_TOKENS_FILE: cannot read {path}: {exc.strerror}") from None
    return text.splitlines()


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
    stall_notice_s: float = Field(
        default=300.0,
        gt=0,
        description="a running job whose progress has not moved for this long (and for 20 of its usual "
        "intervals between reported steps) says so in its waiting_reason; its threads' stacks go to its log",
    )
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
    keep_checkpoints: int | None = Field(
        default=None,
        ge=1,
        description="how many of a job's newest verified checkpoints its MLflow run keeps (older ones "
        "are removed as newer ones come); unset: every one",
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

    @field_validator("api_tokens_file", "keep_checkpoints", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        # `OPTLAB_API_TOKENS_FILE=` (compose's `${VAR:-}`) means no file, not the current folder;
        # `OPTLAB_KEEP_CHECKPOINTS=` keeps every checkpoint.
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _read_tokens(self) -> Settings:
        entries = parse_tokens(self.api_tokens.split(","), "OPTLAB_API_TOKENS")
        if self.api_tokens.strip() and not entries:
            raise ValueError(_NO_ENTRIES.format(what="OPTLAB_API_TOKENS is set but"))
        if self.api_tokens_file is not None:
            from_file = parse_tokens(
                _read_token_file(self.api_tokens_file),
                f"OPTLAB_API_TOKENS_FILE {self.api_tokens_file}",
                "line",
            )
            if not from_file:
                raise ValueError(_NO_ENTRIES.format(what=f"OPTLAB_API_TOKENS_FILE {self.api_tokens_file}"))
            entries += from_file
        _refuse_repeats(entries)
        self._tokens = [entry.token for entry in entries]
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
