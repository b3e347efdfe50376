-- Run by the postgres image on its first start (an empty pgdata volume): MLflow's backend store
-- gets its own database, since MLflow and optlab each keep an `alembic_version` table.
CREATE DATABASE mlflow;
