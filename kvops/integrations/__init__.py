"""Integrations with other libraries (optional extras; ``import kvops`` never imports them)."""
