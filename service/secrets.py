"""Credentials stay where they belong: out of job processes that do not need them, out of command
lines, files, log lines and API answers.

A tracking URI may carry MLflow credentials (`https://user:password@mlflow.example`): they are
taken out of the URI and handed to the job through MLflow's own variables
(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), which the MLflow client reads.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

REDACTED = "***"
# Query parameters that carry a credential in the URLs people paste (tokens, keys, signatures).
SECRET_QUERY = re.compile(r"token|key|secret|password|passwd|pwd|auth|bearer|sig|credential", re.IGNORECASE)
# What a job process needs from optlab's own settings: where plugins are, where data files may be,
# the shared checkpoint folder (jobs/resume.py).
JOB_OPTLAB_VARIABLES = frozenset({"OPTLAB_PLUGIN_DIRS", "OPTLAB_DATA_ROOTS", "OPTLAB_CHECKPOINT_DIR"})
# Credentials of other tools a worker may hold that a job never needs: libpq's, and the compose
# .env's PostgreSQL password (docker-compose.yml hands the worker .env, which holds it).
OTHER_SECRETS = frozenset(
    {
        "PGPASSWORD",
        "PGPASSFILE",
        "DATABASE_URL",
        "MLFLOW_TRACKING_URI",
        "POSTGRES_PASSWORD",
        "POSTGRES_PASSWORD_FILE",
    }
)
# Any other password a worker's environment holds (`*_PASSWORD`, `*_PASSWORD_FILE`) is not the job's
# either; MLflow's own is the one a job needs (job_environment sets it from the tracking URI).
PASSWORD_NAME = re.compile(r"(?:^|_)(?:PASSWORD|PASSWD)(?:_FILE)?$", re.IGNORECASE)
JOB_CREDENTIALS = frozenset({"MLFLOW_TRACKING_PASSWORD"})
# Only the API checks tokens: every other process of optlab's is started without them.
TOKEN_VARIABLES = frozenset({"OPTLAB_API_TOKENS", "OPTLAB_API_TOKENS_FILE"})
PR_SET_DUMPABLE = 4


def keep_process_private() -> None:
    """Linux: other processes of this user can no longer read this one's environment or memory in
    /proc (`/proc/PID/environ` becomes root's), nor attach a debugger to it; it leaves no core dump.

    Why: jobs run optimizer code anyone with a plugin can write, as the user the worker and the API
    run as. A job is handed no secret (`job_environment`), but without this it could read the
    worker's database URL or the API's tokens from /proc. Processes started from this one are
    ordinary again (execve resets the flag), so jobs are unaffected. Elsewhere, a no-op.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def without_tokens(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less the API's tokens, for the processes that do not check them."""
    return {name: value for name, value in environ.items() if name not in TOKEN_VARIABLES}


def without_optlab_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less every optlab setting (the job store's URL, the tokens) and the other tools'
    credentials: for `optlab serve`'s MLflow server, which needs none of them."""
    return {
        name: value
        for name, value in environ.items()
        if not name.startswith("OPTLAB_") and name not in OTHER_SECRETS
    }


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """`http://u:p@host/x` -> (`http://host/x`, `u`, `p`); a URL without userinfo comes back as is."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port is not None else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    username = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return clean, username, password


def redact_url(url: str) -> str:
    """The URL with its userinfo and credential-like query values replaced by ***, for showing."""
    try:
        parts = urlsplit(url)
        clean, username, password = split_credentials(url)
    except ValueError:  # not parseable (a bad port): show nothing of it rather than a secret
        return REDACTED
    if username is None and password is None and not parts.query:
        return url  # as given: rebuilt, `sqlite:////tmp/x.db` lost two slashes (an empty netloc)
    if username is not None or password is not None:
        parts = urlsplit(clean)
        parts = parts._replace(netloc=f"{REDACTED}@{parts.netloc}")
    if parts.query:
        query = [(k, REDACTED if SECRET_QUERY.search(k) else v) for k, v in parse_qsl(parts.query, True)]
        parts = parts._replace(query=urlencode(query, safe="*"))
    return urlunsplit(parts)


def job_environment(environ: Mapping[str, str], tracking_uri: str) -> tuple[dict[str, str], str]:
    """The environment a job process gets and the tracking URI for its command line.

    Only what a job needs: no job-store URL (the worker reports for it), no API tokens (nor the
    client's OPTLAB_TOKEN), no PostgreSQL or other password (compose's POSTGRES_PASSWORD, any
    `*_PASSWORD`), and the MLflow credentials through MLflow's own variables instead of in the URI.
    """
    env = {
        key: value
        for key, value in environ.items()
        if (not key.startswith("OPTLAB_") or key in JOB_OPTLAB_VARIABLES)
        and key not in OTHER_SECRETS
        and (key in JOB_CREDENTIALS or not PASSWORD_NAME.search(key))
    }
    clean, username, password = split_credentials(tracking_uri)
    if username:
        env["MLFLOW_TRACKING_USERNAME"] = username
    if password:
        env["MLFLOW_TRACKING_PASSWORD"] = password
    env["PYTHONUNBUFFERED"] = "1"
    return env, clean
