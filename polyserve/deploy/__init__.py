"""The writes: deploys, dependencies, validation and the fork server it runs in."""
