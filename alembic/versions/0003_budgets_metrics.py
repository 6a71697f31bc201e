"""team budgets and automatic rollback rules (admin UI: chargeback budgets, safe rollouts)

Revision ID: 0003
Revises: 0001
Create Date: 2026-11-30
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('team_budgets',
    sa.Column('team', sa.String(length=128), nullable=False),
    sa.Column('monthly_amount', sa.Float(), nullable=False),
    sa.Column('currency', sa.String(length=8), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_by', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['team'], ['teams.name'], ),
    sa.PrimaryKeyConstraint('team')
    )
    op.create_table('rollback_rules',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('max_error_rate', sa.Float(), nullable=True),
    sa.Column('max_ttft_ms_p95', sa.Float(), nullable=True),
    sa.Column('minutes', sa.Integer(), nullable=False),
    sa.Column('armed', sa.Boolean(), nullable=False),
    sa.Column('armed_by', sa.String(length=128), nullable=False),
    sa.Column('armed_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('fired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('fired_reason', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('model', 'version')
    )


def downgrade() -> None:
    op.drop_table('rollback_rules')
    op.drop_table('team_budgets')
