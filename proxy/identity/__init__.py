"""Who is calling: API keys, JWTs, guests, and the key store."""
