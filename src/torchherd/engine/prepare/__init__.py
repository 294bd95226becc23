"""Getting the nodes ready before a job starts: the project synced, the venvs built (with
offline wheels where a node has no index), images pulled or loaded, a checkpoint staged;
the relay chain they share."""
