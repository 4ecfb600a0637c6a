"""The meter, its Prometheus text, and what mapped files cost the host."""
