"""Translation between API styles and upstream dialects (pure)."""
