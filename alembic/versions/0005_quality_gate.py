"""quality gate report stored with each model version (build-engines' gate; the rollout rule reads it)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('models') as batch:
        batch.add_column(sa.Column('quality_gate', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('models') as batch:
        batch.drop_column('quality_gate')
