"""Load tests: the benchmark driver (`python -m loadtests.bench`) and locust scenarios."""
