"""fair heads: each router's virtual time and best waiting finish tags per admission queue (fair shares
across routers, router_service/fair_sync.py)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('fair_heads',
    sa.Column('router_id', sa.String(length=128), nullable=False),
    sa.Column('queue', sa.String(length=256), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('vt', sa.Float(), nullable=False),
    sa.Column('heads', sa.JSON(), nullable=False),
    sa.Column('teams', sa.JSON(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('router_id', 'queue')
    )


def downgrade() -> None:
    op.drop_table('fair_heads')
