"""Durable jobs: each job's last verified checkpoint, and the workers with what they can run.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("checkpoint_step", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("checkpoint_ref", sa.String(2000), nullable=True))
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.String(200), primary_key=True),
        sa.Column("frameworks", sa.JSON(), nullable=False),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("catalogue_sha256", sa.String(64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_workers_last_seen", "workers", ["last_seen"])


def downgrade() -> None:
    op.drop_index("ix_workers_last_seen", "workers")
    op.drop_table("workers")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("checkpoint_ref")
        batch.drop_column("checkpoint_step")
