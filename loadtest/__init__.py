"""Load generators, benchmarks and their reports (tables, JSON, PNG plots)."""
