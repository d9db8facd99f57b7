"""Credits: prices (pure), the ledger, per-request metering, idempotent retries."""
