"""Sample third-party hpctrain plugin."""
