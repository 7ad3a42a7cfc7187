"""Filters: single-instance ones judge each candidate, global ones (failure domains) run after."""
