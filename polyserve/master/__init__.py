"""gunicorn's master hooks, and a killed master's segment."""
