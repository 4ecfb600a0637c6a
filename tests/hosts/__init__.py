"""Real-host scenarios across wings: gunicorn hosts started for whole stories."""
