"""per-key budgets: an API key's own budget besides its team's, reserved and settled with the same lease

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('key_budgets',
    sa.Column('caller', sa.String(length=128), nullable=False),
    sa.Column('monthly_amount', sa.Float(), nullable=False),
    sa.Column('currency', sa.String(length=8), nullable=False),
    sa.Column('period', sa.String(length=8), nullable=False),
    sa.Column('unit', sa.String(length=8), nullable=False),
    sa.Column('soft_share', sa.Float(), nullable=False),
    sa.Column('enforce', sa.Boolean(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_by', sa.String(length=128), nullable=False),
    sa.ForeignKeyConstraint(['caller'], ['callers.name'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('caller')
    )
    op.create_table('key_budget_spend',
    sa.Column('caller', sa.String(length=128), nullable=False),
    sa.Column('period', sa.String(length=10), nullable=False),
    sa.Column('spent', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('caller', 'period')
    )
    with op.batch_alter_table('inflight_leases') as t:
        t.add_column(sa.Column('key_budget_period', sa.String(length=10), nullable=False, server_default=''))
        t.add_column(sa.Column('key_budget_reserved', sa.Float(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('inflight_leases') as t:
        t.drop_column('key_budget_reserved')
        t.drop_column('key_budget_period')
    op.drop_table('key_budget_spend')
    op.drop_table('key_budgets')
