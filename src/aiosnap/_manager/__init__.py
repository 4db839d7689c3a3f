"""A checkpoint directory over time: the CheckpointManager, its sites (the local
directory and the remote tier), members of a group, the catalog and its index, retention
and triggers, and the layouts of steps.

Nothing is imported here: the worker process starts from a bare package.
"""
