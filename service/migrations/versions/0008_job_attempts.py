"""A job whose process was killed from outside (out of memory) is retried: how often it was; and
every attempt that ended, with how it ended.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("retries", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("attempt_history", sa.JSON(), nullable=False, server_default="[]"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("attempt_history")
        batch.drop_column("retries")
