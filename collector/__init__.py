"""Episodes and SQL: DuckDB over the sidecar's Parquet records (reads the sidecar's record schema)."""
