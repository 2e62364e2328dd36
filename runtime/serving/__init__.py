"""The OpenAI-compatible HTTP server: routes, the protocol's bodies, errors and metrics."""
