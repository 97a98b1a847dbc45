"""Images: data loaders, models and metrics."""
