"""What spaces say: attributed in the worker, kept on disk per space."""
