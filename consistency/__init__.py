"""consistency: a train/serve consistency linter and tensor-diff tool for speculative decoding."""

__version__ = "0.1.0"
