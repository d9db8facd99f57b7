"""May they: tier access and caps (pure), admission (rate limit and credit hold in one step)."""
