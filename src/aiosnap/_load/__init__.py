"""Loading: resolve what to read, read it verified into its destinations, rebuild the
tree; and verify.

Nothing is imported here: the worker process starts from a bare package.
"""
