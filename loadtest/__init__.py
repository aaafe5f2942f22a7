"""Load generators, benchmarks and their reports (tables, JSON, PNG plots), and the local
harness they run pdcluster in (`local_cluster`: `pdcluster serve` and a Ray head as child
processes, which the test suite uses too)."""
