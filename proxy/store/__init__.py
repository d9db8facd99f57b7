"""The state store: connections to Redis (one server, a Cluster, or a Sentinel-watched primary),
hot-path script pipes, leases for fleet-wide background work, and redis-server processes."""
