"""security: named hashed admin tokens, shared quota usage and in-flight leases, caller canary access and
concurrency cap

Revision ID: 0002
Revises: 0003
Create Date: 2026-11-30
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('admin_tokens',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('name'),
    sa.UniqueConstraint('token_hash')
    )
    op.create_table('quota_usage',
    sa.Column('caller', sa.String(length=128), nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('used_tokens', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('caller', 'day')
    )
    op.create_table('inflight_leases',
    sa.Column('lease_id', sa.String(length=64), nullable=False),
    sa.Column('caller', sa.String(length=128), nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('router_id', sa.String(length=128), nullable=False),
    sa.Column('reserved_tokens', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('lease_id')
    )
    op.create_index(op.f('ix_inflight_leases_caller'), 'inflight_leases', ['caller'], unique=False)
    op.create_index(op.f('ix_inflight_leases_router_id'), 'inflight_leases', ['router_id'], unique=False)
    with op.batch_alter_table('callers') as batch_op:
        batch_op.add_column(sa.Column('canary_access', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('max_concurrent', sa.Integer(), nullable=False, server_default='256'))


def downgrade() -> None:
    with op.batch_alter_table('callers') as batch_op:
        batch_op.drop_column('max_concurrent')
        batch_op.drop_column('canary_access')
    op.drop_index(op.f('ix_inflight_leases_router_id'), table_name='inflight_leases')
    op.drop_index(op.f('ix_inflight_leases_caller'), table_name='inflight_leases')
    op.drop_table('inflight_leases')
    op.drop_table('quota_usage')
    op.drop_table('admin_tokens')
