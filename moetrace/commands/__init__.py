"""CLI command modules; each exposes ``register(cli)``."""
