"""Jobs have a kind: "train" (every job before this revision) or "check" (conformance checks).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The server default fills the column for existing rows on SQLite and PostgreSQL alike.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="train"))
        batch.create_index("ix_jobs_kind", ["kind"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_kind")
        batch.drop_column("kind")
