"""Base: durable file writes, cross-host locks, progress bars and the tier configuration (config.toml)."""
