"""Render reports: terminal (rich), JSON, and the CI formats."""
