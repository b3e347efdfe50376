"""Why a live worker claims no job now (its disk is full), so a queued job's `waiting_reason` can
say so: it had read null, as if the job only waited its turn.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("not_claiming", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("not_claiming")
