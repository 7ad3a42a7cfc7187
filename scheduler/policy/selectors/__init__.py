"""Selectors: pick the target among the candidates that passed the filters, and rank fallbacks."""
