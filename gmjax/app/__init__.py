"""The application around the library: the demo model, data, training job and CLI."""
