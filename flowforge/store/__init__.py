"""PostgreSQL storage: pool, migrations, named queries and the repository."""
