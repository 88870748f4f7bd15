"""Other servers that bench compares baton with, as runnable peers."""
