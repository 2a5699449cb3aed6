"""The OpenAI-compatible HTTP protocol: request parsing, response shapes, errors (no server)."""
