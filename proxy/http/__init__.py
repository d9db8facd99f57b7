"""HTTP plumbing shared by every route: body reading, the middleware, SSE framing."""
