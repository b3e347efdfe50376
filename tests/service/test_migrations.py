"""`optlab serve` starts the API and a worker at once, and both migrate the same fresh
database: every process must succeed and the schema end at the latest revision."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.conftest import ROOT
from tests.postgres import throwaway_database

PROCESSES = 6  # enough to lose the race reliably without the lock (measured: 2 runs in 3)
MIGRATE = "import sys; from service.db import make_engine, migrate; migrate(make_engine(sys.argv[1]))"


def head() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from service.db import MIGRATIONS

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    revision = ScriptDirectory.from_config(config).get_current_head()
    assert revision is not None
    return revision


def migrate_at_once(url: str) -> None:
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", MIGRATE, url], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for _ in range(PROCESSES)
    ]
    outputs = [process.communicate(timeout=120)[0].decode(errors="replace") for process in processes]
    failures = [out[-500:] for process, out in zip(processes, outputs, strict=True) if process.returncode]
    assert not failures, failures[0]
    engine = create_engine(url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head()
        assert connection.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 0
    engine.dispose()


def test_concurrent_migrations_of_a_fresh_sqlite_database(tmp_path: Path) -> None:
    migrate_at_once(f"sqlite:///{tmp_path / 'optlab.db'}")


def test_concurrent_migrations_of_a_fresh_postgresql_database() -> None:
    with throwaway_database("optlab_migrate") as url:
        migrate_at_once(url)


def schema_drift(url: str) -> list[object]:
    """What the migrated schema lacks or has beyond the ORM's tables (columns, types, indexes)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from service.db import make_engine, migrate
    from service.models import Base

    engine = make_engine(url)
    migrate(engine)
    with engine.connect() as connection:
        drift = compare_metadata(
            MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata
        )
    engine.dispose()
    return list(drift)


def test_the_migrations_build_the_schema_the_models_describe(tmp_path: Path) -> None:
    """A column added to a model without its migration (or the reverse) fails here, not in production."""
    assert schema_drift(f"sqlite:///{tmp_path / 'optlab.db'}") == []
    with throwaway_database("optlab_drift") as url:
        assert schema_drift(url) == []
