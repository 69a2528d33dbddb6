"""Training: optimizer, data pipeline, trainer loop and metrics."""
