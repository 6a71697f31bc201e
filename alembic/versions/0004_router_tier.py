"""router tier: shared per-key request and token rates, team budgets enforced at admission, fair-share weights

Revision ID: 0004
Revises: 0002
Create Date: 2026-12-04
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('teams') as t:
        t.add_column(sa.Column('fair_weight', sa.Float(), nullable=False, server_default='1.0'))
    with op.batch_alter_table('callers') as t:
        t.add_column(sa.Column('requests_per_s', sa.Float(), nullable=False, server_default='0'))
        t.add_column(sa.Column('tokens_per_minute', sa.BigInteger(), nullable=False, server_default='0'))
    with op.batch_alter_table('inflight_leases') as t:
        t.add_column(sa.Column('team', sa.String(length=128), nullable=False, server_default=''))
        t.add_column(sa.Column('budget_period', sa.String(length=10), nullable=False, server_default=''))
        t.add_column(sa.Column('budget_reserved', sa.Float(), nullable=False, server_default='0'))
        t.add_column(sa.Column('tpm_minute', sa.BigInteger(), nullable=False, server_default='0'))
    with op.batch_alter_table('team_budgets') as t:
        t.add_column(sa.Column('period', sa.String(length=8), nullable=False, server_default='month'))
        t.add_column(sa.Column('unit', sa.String(length=8), nullable=False, server_default='money'))
        t.add_column(sa.Column('soft_share', sa.Float(), nullable=False, server_default='0.8'))
        t.add_column(sa.Column('enforce', sa.Boolean(), nullable=False, server_default=sa.true()))
    op.create_table('caller_rates',
    sa.Column('caller', sa.String(length=128), nullable=False),
    sa.Column('sec_start', sa.BigInteger(), nullable=False),
    sa.Column('sec_count', sa.Integer(), nullable=False),
    sa.Column('sec_prev', sa.Integer(), nullable=False),
    sa.Column('min_start', sa.BigInteger(), nullable=False),
    sa.Column('min_tokens', sa.BigInteger(), nullable=False),
    sa.Column('min_prev', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('caller')
    )
    op.create_table('budget_spend',
    sa.Column('team', sa.String(length=128), nullable=False),
    sa.Column('period', sa.String(length=10), nullable=False),
    sa.Column('spent', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('team', 'period')
    )


def downgrade() -> None:
    op.drop_table('budget_spend')
    op.drop_table('caller_rates')
    with op.batch_alter_table('team_budgets') as t:
        for col in ('enforce', 'soft_share', 'unit', 'period'):
            t.drop_column(col)
    with op.batch_alter_table('inflight_leases') as t:
        for col in ('tpm_minute', 'budget_reserved', 'budget_period', 'team'):
            t.drop_column(col)
    with op.batch_alter_table('callers') as t:
        t.drop_column('tokens_per_minute')
        t.drop_column('requests_per_s')
    with op.batch_alter_table('teams') as t:
        t.drop_column('fair_weight')
