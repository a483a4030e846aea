"""modelship: from a model name to a fast, autoscaled, OpenAI-compatible production API."""

__version__ = "0.1.0"
