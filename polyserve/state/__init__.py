"""What the master and the workers share: the store, the slots, the table, broadcast."""
