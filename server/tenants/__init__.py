"""Tenants: API keys mapped to names, allowed models, a priority clamp and rate limits."""
