"""Jobs record which API token's name submitted them (null: an open API, or before this revision).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("submitted_by", sa.String(64), nullable=True))
        batch.create_index("ix_jobs_submitted_by", ["submitted_by"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_submitted_by")
        batch.drop_column("submitted_by")
