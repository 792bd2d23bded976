"""Rendering shared by every command: text, JSON, Markdown (plots live in report.plots)."""
