"""What a study's summary, still being made, waits on (MLflow not answering): shown on the study apart
from `finalize_error`, a summary that failed and is retried.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("studies") as batch:
        batch.add_column(sa.Column("summary_waiting", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("studies") as batch:
        batch.drop_column("summary_waiting")
