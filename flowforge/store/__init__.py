"""PostgreSQL storage: pool, migrations, named queries and the store's parts by caller."""
