"""Studies (optimizers x grid points x seeds) and the jobs' `study_id`.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "studies",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("members", sa.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("submitted_by", sa.String(64), nullable=True),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
        sa.Column("experiment_id", sa.String(64), nullable=True),
        sa.Column("parent_run_id", sa.String(64), nullable=True),
        sa.Column("finalizing_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finalized_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finalize_error", sa.Text, nullable=True),
        sa.Column("summary", sa.JSON, nullable=True),
        sa.Column("report_html", sa.Text, nullable=True),
    )
    op.create_index("ix_studies_submitted_by", "studies", ["submitted_by"])
    op.create_index("ix_studies_finalized_at", "studies", ["finalized_at"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("study_id", sa.Integer, nullable=True))
        batch.create_index("ix_jobs_study_id", ["study_id"])
        batch.create_foreign_key("fk_jobs_study_id", "studies", ["study_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint("fk_jobs_study_id", type_="foreignkey")
        batch.drop_index("ix_jobs_study_id")
        batch.drop_column("study_id")
    op.drop_index("ix_studies_finalized_at", "studies")
    op.drop_index("ix_studies_submitted_by", "studies")
    op.drop_table("studies")
