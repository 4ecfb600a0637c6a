"""The door: the gunicorn worker class, the strict HTTP/1 protocol, the response cycle."""
