"""Streamlit admin UI: fleet, rollouts, warm buffers, chargeback, capacity."""
