"""The control plane under /_polyserve: who may write, the OpenAPI page, the dashboard."""
