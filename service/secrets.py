"""Credentials stay where they belong: out of job processes that do not need them, out of command
lines, files, log lines and API answers.

A tracking URI may carry MLflow credentials (`https://user:password@mlflow.example`): they are
taken out of the URI and handed to the job through MLflow's own variables
(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), which the MLflow client reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

REDACTED = "***"
# Query parameters that carry a credential in the URLs people paste (tokens, keys, signatures).
SECRET_QUERY = re.compile(r"token|key|secret|password|passwd|pwd|auth|sig|credential", re.IGNORECASE)
# What a job process needs from optlab's own settings: where plugins and shared checkpoints are.
JOB_OPTLAB_VARIABLES = frozenset({"OPTLAB_PLUGIN_DIRS", "OPTLAB_CHECKPOINT_DIR"})
# Credentials of other tools a worker may hold that a job never needs.
OTHER_SECRETS = frozenset({"PGPASSWORD", "PGPASSFILE", "DATABASE_URL", "MLFLOW_TRACKING_URI"})


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
    if username is not None or password is not None:
        parts = urlsplit(clean)
        parts = parts._replace(netloc=f"{REDACTED}@{parts.netloc}")
    if parts.query:
        query = [(k, REDACTED if SECRET_QUERY.search(k) else v) for k, v in parse_qsl(parts.query, True)]
        parts = parts._replace(query=urlencode(query, safe="*"))
    return urlunsplit(parts)


def job_environment(environ: Mapping[str, str], tracking_uri: str) -> tuple[dict[str, str], str]:
    """The environment a job process gets and the tracking URI for its command line.

    Only what a job needs: no job-store URL (the worker reports for it), no API tokens, and the
    MLflow credentials through MLflow's own variables instead of in the URI.
    """
    env = {
        key: value
        for key, value in environ.items()
        if (not key.startswith("OPTLAB_") or key in JOB_OPTLAB_VARIABLES) and key not in OTHER_SECRETS
    }
    clean, username, password = split_credentials(tracking_uri)
    if username:
        env["MLFLOW_TRACKING_USERNAME"] = username
    if password:
        env["MLFLOW_TRACKING_PASSWORD"] = password
    env["PYTHONUNBUFFERED"] = "1"
    return env, clean
