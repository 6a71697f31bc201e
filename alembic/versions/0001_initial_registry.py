"""initial registry

Revision ID: 0001
Revises: 
Create Date: 2026-11-29
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('audit_log',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('action', sa.String(length=64), nullable=False),
    sa.Column('target', sa.String(length=256), nullable=False),
    sa.Column('before', sa.JSON(), nullable=True),
    sa.Column('after', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('models',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('weights_uri', sa.Text(), nullable=False),
    sa.Column('dtype', sa.String(length=16), nullable=False),
    sa.Column('tensor_parallel', sa.Integer(), nullable=False),
    sa.Column('max_context', sa.Integer(), nullable=False),
    sa.Column('engine_kind', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('status_reason', sa.Text(), nullable=False),
    sa.Column('repository_path', sa.Text(), nullable=False),
    sa.Column('build_info', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name', 'version')
    )
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_models_name'), ['name'], unique=False)

    op.create_table('registry_meta',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('replicas',
    sa.Column('replica_id', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('region', sa.String(length=32), nullable=False),
    sa.Column('grpc_url', sa.String(length=256), nullable=False),
    sa.Column('http_url', sa.String(length=256), nullable=False),
    sa.Column('metrics_url', sa.String(length=256), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('replica_id')
    )
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_replicas_model'), ['model'], unique=False)

    op.create_table('routes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('percent', sa.Integer(), nullable=False),
    sa.Column('pools', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('model', 'version')
    )
    with op.batch_alter_table('routes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_routes_model'), ['model'], unique=False)

    op.create_table('teams',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('cost_center', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('warm_buffers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('min_idle_replicas', sa.Integer(), nullable=False),
    sa.Column('min_replicas', sa.Integer(), nullable=False),
    sa.Column('max_replicas', sa.Integer(), nullable=False),
    sa.Column('slo_ttft_ms_p95', sa.Integer(), nullable=False),
    sa.Column('slo_tokens_per_s', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('model', 'version')
    )
    op.create_table('adapters',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('base_version', sa.String(length=64), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('owner_team', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.ForeignKeyConstraint(['owner_team'], ['teams.name'], ),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('callers',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('api_key_hash', sa.String(length=64), nullable=False),
    sa.Column('team', sa.String(length=128), nullable=False),
    sa.Column('max_tier', sa.String(length=16), nullable=False),
    sa.Column('token_quota_per_day', sa.BigInteger(), nullable=False),
    sa.Column('allowed_models', sa.JSON(), nullable=False),
    sa.Column('allowed_adapters', sa.JSON(), nullable=False),
    sa.Column('region', sa.String(length=32), nullable=False),
    sa.ForeignKeyConstraint(['team'], ['teams.name'], ),
    sa.PrimaryKeyConstraint('name')
    )
    with op.batch_alter_table('callers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_callers_api_key_hash'), ['api_key_hash'], unique=True)

    op.bulk_insert(sa.table('registry_meta', sa.column('id', sa.Integer), sa.column('version', sa.BigInteger)), [{'id': 1, 'version': 1}])


def downgrade() -> None:
    with op.batch_alter_table('callers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_callers_api_key_hash'))

    op.drop_table('callers')
    op.drop_table('adapters')
    op.drop_table('warm_buffers')
    op.drop_table('teams')
    with op.batch_alter_table('routes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_routes_model'))

    op.drop_table('routes')
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_replicas_model'))

    op.drop_table('replicas')
    op.drop_table('registry_meta')
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_models_name'))

    op.drop_table('models')
    op.drop_table('audit_log')
