"""The autoscaler: busy ratio from the fleet's hosts, scaling decisions, and providers."""
