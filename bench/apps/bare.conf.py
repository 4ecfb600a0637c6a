"""An empty gunicorn configuration: gunicorn reads ./gunicorn.conf.py when given none, and a
bench's bare gunicorn runs in the repository, whose gunicorn.conf.py is polyserve's host."""
